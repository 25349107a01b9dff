"""The `Trainer`: model + optimizer + LR schedule, and the optimizer steps of a batch.

`train_step` is the RL algorithm in a screenful: advantages from rewards,
per-token aggregation weights from the whole batch, this rank's share in
micro-batches, optional recomputation of the old and reference logprobs,
loss and backward per micro-batch, clip, step. `sft_step` is the same
machinery with the negative log-likelihood.

Exact accumulation across micro-batches *and ranks*: each micro-batch's loss
is sum(w · l) with weights that already normalise by the global batch, so
the per-rank sums add up to the full-batch loss. FSDP2 *averages* gradients
over ranks in its reduce-scatter; the backward therefore uses
loss × world_size, making the reduced gradient the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.runtime.diskroom import tensor_bytes
from services.trainer import lora
from services.trainer.core.advantages import compute_advantages
from services.trainer.core.batching import (
    BatchError,
    MetricAccumulator,
    TensorBatch,
    collate,
    layout_sample,
    plan_micro_batches,
    shard_for_ranks,
    split_groups,
)
from services.trainer.core.distill import distill_advantages
from services.trainer.core.loss import (
    LossOutput,
    next_entropy_coef,
    policy_loss,
    sample_weights,
)
from services.trainer.core.lr import describe_auto_lr, resolve_lr
from services.trainer.core.packing import collate_packed, plan_packed
from services.trainer.core.prefix import Tree, collate_trees, plan_trees
from services.trainer.core.schedule import lr_multiplier
from services.trainer.distributed import DistInfo, all_reduce, barrier
from services.trainer.forward import ForwardSpec, token_stats
from services.trainer.model import (
    check_plain_head,
    compute_dtype,
    load_model,
    load_tokenizer,
    prepare_model,
)
from services.trainer.randomness import seed_default, trainer_generator
from services.trainer.settings import TrainConfig
from services.trainer.stopwatch import Stopwatch
from services.weights import Manifest, write_weights_dir

Row = dict[str, torch.Tensor]
MicroBatch = dict[str, torch.Tensor]


@dataclass
class SftExample:
    """One supervised sequence: token ids and a per-token 0/1 loss mask on the same ids."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] 0/1, 1 where the token is a training target


class Trainer:
    """Holds the state that training changes; everything else is a function."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: TrainConfig,
        info: DistInfo,
        ref_model: torch.nn.Module | None = None,
        adapter: dict[str, Any] | None = None,
        *,
        n_params: int,
    ):
        """`n_params`: the policy's parameter count before sharding and adapters (the base
        model's with LoRA), which `optim.lr = "auto"` is resolved from (core/lr.py)."""
        self.model, self.tokenizer, self.cfg, self.info = model, tokenizer, cfg, info
        self.ref_model = ref_model
        # Weights go out in the dtype they came in (a bf16 checkpoint: half the bytes to
        # write, hash, send and load; bf16 deltas), whatever the float32 masters train in.
        self.publish_dtype: torch.dtype | None = None
        # With [trainer.lora]: the adapter's adapter_config.json; its versions are adapters.
        self.adapter = adapter
        o = cfg.optim
        # The base lr, resolved once: the optimizer's, so the schedule, the metrics' `lr`
        # and a checkpoint's param groups all carry this number, never "auto".
        self.n_params = n_params
        self.lr = resolve_lr(o.lr, n_params, lora=cfg.lora is not None)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=self.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_multiplier(
                s,
                warmup_steps=o.warmup_steps,
                total_steps=o.total_steps,
                kind=o.schedule,
                min_lr_ratio=o.min_lr_ratio,
            ),
        )
        self.step = 0
        self.weight_version = 0
        # The entropy bonus weight of the next step: fixed, or moved after each step by the
        # adaptive controller (core/loss.next_entropy_coef); checkpoints keep it (state.py).
        self.entropy_coef = cfg.loss.entropy_coef
        # Every random draw of a step comes from here, never torch's default generator,
        # which an evaluation thread may touch (randomness.py); checkpoints keep it.
        self.generator = trainer_generator(cfg.model.seed)
        self.watch = Stopwatch()  # an RL step's time by stage (its metrics' time_*_s)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.forward_spec = forward_spec(cfg, info)
        self.packing = packs(cfg, info)
        if cfg.model.logprobs == "chunked":
            check_plain_head(model)

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, cfg: TrainConfig, info: DistInfo | None = None
    ) -> Trainer:
        """Load policy (and reference, when kl_coef > 0) from a local HF dir and shard them."""
        info = info or DistInfo()
        m = cfg.model
        if m.cpu_threads is not None and info.device.type == "cpu":
            torch.set_num_threads(m.cpu_threads)
        torch.manual_seed(m.seed)
        dtype = compute_dtype(m.precision, info.device)
        attention = attention_for(cfg, info)
        if cfg.lora is not None:
            lora.check_base(model_dir)  # engines load the base the adapter names, as it is
        policy = load_model(model_dir)
        n_params = parameter_count(policy)  # every rank holds the whole model here
        adapter = None
        if cfg.lora is not None:  # before sharding: FSDP2 wraps the layers with their adapters
            policy = lora.apply(policy, cfg.lora)
            adapter = lora.config_doc(cfg.lora, base=str(Path(model_dir).expanduser().resolve()))
        model = prepare_model(
            policy,
            info,
            activation_checkpointing=m.activation_checkpointing,
            dtype=dtype,
            attention=attention,
        )
        ref = None
        if cfg.loss.kl_coef > 0:  # frozen: no float32 master copy needed
            frozen = load_model(model_dir, dtype=dtype)
            ref = prepare_model(frozen, info, dtype=dtype, trainable=False, attention=attention)
        trainer = cls(model, load_tokenizer(model_dir), cfg, info, ref, adapter, n_params=n_params)
        trainer.publish_dtype = stored_dtype(model_dir)
        return trainer

    def auto_lr_note(self, section: str) -> str | None:
        """What `lr = "auto"` became, for the start-up log; None where the lr was a number."""
        if self.cfg.optim.lr != "auto":
            return None
        lora = self.cfg.lora is not None
        return describe_auto_lr(self.lr, self.n_params, lora=lora, section=section)

    # ---- the algorithm -------------------------------------------------------------

    def train_step(self, batch: TensorBatch) -> dict[str, float]:
        """Train on one RL batch: `optim.minibatches` optimizer steps over its groups.

        Returns batch-level metrics (the mean over mini-batches; same on all ranks), with
        `entropy_coef` the bonus weight this step used; the adaptive entropy controller
        then moves it for the next step (metrics are the same on every rank, so is it).
        """
        batch.validate()
        seed_default(self.generator)  # dropout's masks, from the trainer's own state
        coef = self.entropy_coef
        parts = split_groups(batch, self.cfg.optim.minibatches)
        # Only the first mini-batch sees the weights of version `self.step` (the mismatch).
        results = [
            self._train_minibatch(p, self.step if i == 0 else None) for i, p in enumerate(parts)
        ]
        self.step += 1
        keys = dict.fromkeys(k for r in results for k in r)  # some only where measured
        merged = {
            k: sum(r[k] for r in results if k in r) / sum(k in r for r in results) for k in keys
        }
        merged["lr"] = results[-1]["lr"]
        merged["entropy_coef"] = coef
        self.entropy_coef = next_entropy_coef(coef, merged.get("entropy"), self.cfg.loss)
        timings = self.watch.take()  # summed over the mini-batches, not averaged
        return {**merged, **timings, "step": self.step, "minibatches": len(results)}

    def _train_minibatch(self, batch: TensorBatch, version: int | None) -> dict[str, float]:
        """`version`: the weight version the model holds before this mini-batch's update
        (None: unknown, after an earlier mini-batch's)."""
        with self.watch("prepare"):  # advantages, layout, micro-batches
            micro = self._micro_batches(self._rl_rows(batch, version), batch.group_ids.tolist())
        with self.watch("logprobs"):  # the no-grad passes: old and reference logprobs
            if self.cfg.loss.old_logprobs == "recompute":
                self._fill_logprobs(micro, "old_logprobs", self.model, batch.temperature)
            if self.ref_model is not None:
                self._fill_logprobs(micro, "ref_logprobs", self.ref_model, batch.temperature)
        t, entropy = batch.temperature, self._wants_entropy()
        return self._accumulate_and_step(micro, lambda mb: self._rl_loss(mb, t, entropy))

    def _wants_entropy(self) -> bool:
        """Entropy costs a pass over every chunk of logits: only as a bonus, for the adaptive
        controller (it reads every step's), or when logged."""
        every = self.cfg.model.entropy_every
        logged = every > 0 and (self.step + 1) % every == 0  # self.step + 1: the step trained
        adaptive = self.cfg.loss.entropy_control == "adaptive"
        return self.entropy_coef > 0 or adaptive or logged

    def sft_step(self, examples: list[SftExample]) -> dict[str, float]:
        """One optimizer step of token-mean negative log-likelihood over `examples`."""
        micro = self._micro_batches(self._sft_rows(examples))
        metrics = self._accumulate_and_step(micro, self._sft_loss)
        self.watch.take()  # SFT reports no stages
        self.step += 1
        return {**metrics, "step": self.step}

    @torch.no_grad()
    def sft_eval_loss(self, examples: list[SftExample]) -> float:
        """Token-mean NLL of `examples` without updating (same on all ranks)."""
        self.model.eval()
        acc = MetricAccumulator()
        for mb in self._micro_batches(self._sft_rows(examples)):
            acc.add(self._sft_loss(mb))
        self.model.train()
        return self._reduce(acc)["loss"]

    # ---- batch preparation (pure given the batch) ----------------------------------

    def _rl_rows(self, batch: TensorBatch, version: int | None = None) -> list[Row]:
        lc = self.cfg.loss
        adv = compute_advantages(
            batch.rewards.float(),
            batch.group_ids,
            lc.advantage,
            lc.advantage_eps,
            lc.batch_normalize_advantages,
        )  # [N]
        masks = []
        for i in range(len(batch)):
            r = batch.response_ids[i].numel()
            m = batch.loss_mask[i].float() if batch.loss_mask is not None else torch.ones(r)
            if lc.drop_truncated and bool(batch.truncated[i]):
                m = torch.zeros(r)
            masks.append(m)
        w = sample_weights(
            torch.tensor([float(m.sum()) for m in masks]), lc.aggregation, lc.norm_tokens
        )  # [N]
        rows = []
        for i in range(len(batch)):
            m = masks[i]
            per_token = {
                "loss_mask": m,
                "weights": m * float(w[i]),
                "advantages": self._advantages(batch, i, float(adv[i]), m),
                "rollout_logprobs": batch.rollout_logprobs[i].float(),
            }
            if version is not None and batch.token_versions is not None:
                per_token["same_version"] = (batch.token_versions[i] == version).float()
            rows.append(layout_sample(batch.prompt_ids[i], batch.response_ids[i], per_token))
        return rows

    def _advantages(self, batch: TensorBatch, i: int, task: float, m: torch.Tensor) -> torch.Tensor:
        """Sample i's per-token advantages [R]: the task's, or with [trainer.distill] the
        reverse KL to its teacher's logprobs beside it (core/distill.py)."""
        cfg = self.cfg.distill
        if cfg is None:
            return torch.full_like(m, task)
        teacher = batch.teacher_logprobs[i] if batch.teacher_logprobs is not None else None
        if teacher is None:
            raise BatchError(
                "[trainer.distill] is set but the sample carries no teacher logprobs: give "
                "the rollout workers a [teacher] table (docs/distillation.md)",
                sample=i,
                field="teacher_logprobs",
            )
        return distill_advantages(task, batch.rollout_logprobs[i].float(), teacher, m, cfg)

    def _sft_rows(self, examples: list[SftExample]) -> list[Row]:
        # Target position j predicts token j + 1, so the mask shifts by one.
        masks = [e.loss_mask[1:].float() for e in examples]
        w = sample_weights(torch.tensor([float(m.sum()) for m in masks]), "token-mean")
        return [
            {"input_ids": e.input_ids.long(), "loss_mask": m, "weights": m * float(w[i])}
            for i, (e, m) in enumerate(zip(examples, masks, strict=True))
        ]

    def _micro_batches(
        self, rows: list[Row], group_ids: list[int] | None = None
    ) -> list[MicroBatch]:
        """This rank's rows in micro-batches; every rank gets the same count (FSDP needs it).

        With `group_ids` (RL) and packed rows, each group's common prefix is computed once
        (`share_prefix`: core/prefix.py); otherwise one row per sample.
        """
        budget = self.cfg.model.micro_batch_tokens
        trees = group_ids is not None and self.packing and self.cfg.model.share_prefix
        micro = (
            self._tree_micro_batches(rows, group_ids, budget)
            if trees and group_ids is not None
            else self._row_micro_batches(rows, budget)
        )
        count = int(all_reduce(torch.tensor([len(micro)]), self.info, "max").item())
        while len(micro) < count:  # a zero-weight row keeps the collectives in step
            micro.append(self._dummy_micro_batch(rows[0], trees))
        return micro

    def _row_micro_batches(self, rows: list[Row], budget: int) -> list[MicroBatch]:
        lengths = [r["input_ids"].numel() for r in rows]
        mine = shard_for_ranks(lengths, self.info.world_size)[self.info.rank]
        packed = self.packing
        plan = (plan_packed if packed else plan_micro_batches)([lengths[i] for i in mine], budget)
        join = collate_packed if packed else collate
        return [join([rows[mine[j]] for j in group], self.pad_id) for group in plan]

    def _tree_micro_batches(
        self, rows: list[Row], group_ids: list[int], budget: int
    ) -> list[MicroBatch]:
        """Groups as trees, balanced over ranks and packed by the tokens they compute."""
        lengths = [r["input_ids"].numel() for r in rows]
        trees = plan_trees(rows, group_ids, budget)
        costs = [t.cost(lengths) for t in trees]
        mine = shard_for_ranks(costs, self.info.world_size)[self.info.rank]
        plan = plan_packed([costs[i] for i in mine], budget)
        return [collate_trees(rows, [trees[mine[j]] for j in group]) for group in plan]

    def _dummy_micro_batch(self, template: Row, trees: bool = False) -> MicroBatch:
        row = {"input_ids": torch.full((2,), self.pad_id, dtype=torch.long)}
        row.update(
            {k: torch.zeros(1, dtype=v.dtype) for k, v in template.items() if k != "input_ids"}
        )
        if trees:
            return collate_trees([row], [Tree((0,), 2)])
        return (collate_packed if self.packing else collate)([row], self.pad_id)

    # ---- forward / loss ----------------------------------------------------------

    def _token_stats(
        self, model: torch.nn.Module, mb: MicroBatch, temperature: float, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_stats(
            model, mb, self.forward_spec, self.info.device, temperature, entropy=entropy
        )

    @torch.no_grad()
    def _fill_logprobs(
        self, micro: list[MicroBatch], key: str, model: torch.nn.Module, temperature: float
    ) -> None:
        for mb in micro:
            mb[key] = self._token_stats(model, mb, temperature)[0].float().cpu()

    def _rl_loss(self, mb: MicroBatch, temperature: float, entropy: bool = True) -> LossOutput:
        dev = self.info.device
        logp, ent = self._token_stats(self.model, mb, temperature, entropy)  # [B, T']
        if ent is not None and self.entropy_coef == 0:
            ent = ent.detach()  # a metric (or the controller's reading): no backward through it
        on = {k: v.to(dev) for k, v in mb.items()}
        old = (
            on["old_logprobs"]
            if self.cfg.loss.old_logprobs == "recompute"
            else on["rollout_logprobs"]
        )
        return policy_loss(
            logp,
            old,
            on["advantages"],
            on["loss_mask"],
            on["weights"],
            self.cfg.loss,
            rollout_logprobs=on["rollout_logprobs"],
            ref_logprobs=on.get("ref_logprobs"),
            entropy=ent,
            segment_ids=on.get("seq_ids"),
            same_version=on.get("same_version"),
            entropy_coef=self.entropy_coef,
            generator=self.generator,
        )

    def _sft_loss(self, mb: MicroBatch) -> LossOutput:
        dev = self.info.device
        logp, _ = self._token_stats(self.model, mb, 1.0)  # [B, T']
        w, m = mb["weights"].to(dev), mb["loss_mask"].to(dev)
        return LossOutput(loss=-(logp * w).sum(), tokens=m.sum())

    def _accumulate_and_step(
        self, micro: list[MicroBatch], loss_fn: Callable[[MicroBatch], LossOutput]
    ) -> dict[str, float]:
        self.model.train()
        acc = MetricAccumulator()
        with self.watch("forward_backward"):
            for mb in micro:
                out = loss_fn(mb)
                (out.loss * self.info.world_size).backward()
                acc.add(out)
        with self.watch("optimizer"):  # clipping (a collective under FSDP2) and the update
            grad_norm = self._clip_grad_norm()
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {**self._reduce(acc), "grad_norm": grad_norm, "lr": lr}

    def _clip_grad_norm(self) -> float:
        max_norm = self.cfg.optim.grad_clip or float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def _reduce(self, acc: MetricAccumulator) -> dict[str, float]:
        summed, maxed, sk, mk = acc.as_tensors()
        summed = all_reduce(summed, self.info, "sum")
        maxed = all_reduce(maxed, self.info, "max")
        return acc.finalize(summed, maxed, sk, mk)

    # ---- weights out -------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded model state on CPU, on rank 0 only (None elsewhere): with an
        adapter, only the adapter's (the frozen base is the run's model directory)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.adapter is not None
        )
        sd = get_model_state_dict(self.model, options=options)
        if self.adapter is not None:
            sd = lora.trained_only(self.model, sd)
        return sd if self.info.is_main else None  # type: ignore[return-value]

    def save_weights(
        self,
        out_dir: str | Path,
        *,
        overwrite: bool = False,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> Manifest | None:
        """Write an HF directory (config, safetensors, generation config, tokenizer) atomically;
        with an adapter, PEFT's adapter directory instead (services/trainer/lora.py).

        Every rank must call it (the gather is a collective); rank 0 writes
        and returns the manifest, the others return None after it is done.
        `state_dict`: a full state dict copied out earlier (a checkpoint
        `Snapshot`), written instead of the live parameters, so that one
        process can write step N's weights while it trains step N+1.
        """
        sd = state_dict if state_dict is not None else self.full_state_dict()
        manifest = None
        if self.info.is_main:
            assert sd is not None
            adapter = self.adapter
            sd = cast_state(sd, self.publish_dtype)  # an adapter too: bf16 halves its bytes

            def write(tmp: Path) -> None:
                if adapter is not None:
                    lora.write_adapter(tmp, lora.adapter_tensors(sd), adapter)
                    return
                save = self.model.save_pretrained  # a transformers PreTrainedModel method
                save(tmp, state_dict=sd, safe_serialization=True)  # type: ignore[operator]
                self.tokenizer.save_pretrained(tmp)
                if self.publish_dtype is not None:  # the config names the masters' float32
                    name_dtype(tmp / "config.json", self.publish_dtype)

            manifest = write_weights_dir(out_dir, write, overwrite=overwrite, need=tensor_bytes(sd))
        barrier(self.info)
        return manifest


def parameter_count(model: torch.nn.Module) -> int:
    """An unsharded model's parameters, a tied embedding once (`parameters()` yields a
    shared tensor once): SmolLM2-135M counts 134,515,008."""
    return sum(p.numel() for p in model.parameters())


def stored_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The floating dtype a model directory's config says its weights are stored in."""
    import json

    doc = json.loads((Path(model_dir) / "config.json").read_text())
    name = doc.get("dtype") or doc.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def name_dtype(config_json: Path, dtype: torch.dtype) -> None:
    """Make a written config.json say the dtype its weights are stored in."""
    import json

    doc = json.loads(config_json.read_text())
    doc["dtype"] = str(dtype).removeprefix("torch.")
    doc.pop("torch_dtype", None)
    config_json.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def cast_state(sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`sd` with its floating tensors in `dtype` (None: as is); tensors that share storage
    (tied embeddings) still share it, so save_pretrained still sees them tied."""
    if dtype is None:
        return sd
    memo: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if key not in memo:
            memo[key] = t.detach().to(dtype)
        return memo[key]

    return {k: cast(v) for k, v in sd.items()}


def forward_spec(cfg: TrainConfig, info: DistInfo) -> ForwardSpec:
    """How this trainer's forwards run (see services/trainer/forward.py)."""
    m = cfg.model
    dtype = compute_dtype(m.precision, info.device)
    one_process_mixed = dtype != torch.float32 and not info.distributed
    return ForwardSpec(
        logprobs=m.logprobs,
        chunk_mib=m.logits_chunk_mib,
        autocast=dtype if one_process_mixed else None,
        varlen=attention_for(cfg, info) is not None,
    )


def attention_for(cfg: TrainConfig, info: DistInfo) -> str | None:
    """The attention of packed rows: the varlen kernel on a GPU in half precision,
    `flywheel_segments` on CPU (services/trainer/attention.py); None: the model's own."""
    from services.trainer.attention import register_segments, register_varlen, varlen_supported

    if not packs(cfg, info):
        return None
    if varlen_supported(info.device, compute_dtype(cfg.model.precision, info.device)):
        return register_varlen()
    if info.device.type == "cpu":
        return register_segments()
    return None


def packs(cfg: TrainConfig, info: DistInfo) -> bool:
    """Whether micro-batches are packed rows (`packing = "auto"`: where packing was measured
    faster: varlen on a GPU in half precision, segments on a CPU in bf16; a CPU in float32
    pads, its packed step measured 1.1-2.3x slower, bench/results_real_profile.md)."""
    from services.trainer.attention import varlen_supported

    m = cfg.model
    if m.packing == "auto":
        dtype = compute_dtype(m.precision, info.device)
        cpu_bf16 = info.device.type == "cpu" and dtype == torch.bfloat16
        return cpu_bf16 or varlen_supported(info.device, dtype)
    return m.packing

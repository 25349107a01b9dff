"""The base model with one PEFT LoRA adapter per training client, and its sampler.

One `AdapterModel` holds the base weights once and every client's adapter beside
them (PEFT's named adapters on one model): a call activates the caller's adapter,
and PEFT's `set_adapter` makes only that adapter's parameters trainable, so one
client's backward pass cannot put gradients on another's. Each adapter has its
own AdamW (Tinker's Adam: decoupled weight decay, hyperparameters per step).

Every call runs on the service's one model thread (app.py): calls never overlap,
which is what makes switching the active adapter safe. A sampling client samples
from a snapshot of its adapter taken at save_weights_for_sampler (the SDK's
"snapshot" contract: training on after the save does not change what it samples),
loaded into a scratch adapter of the same shape just before it samples.

forward / forward_backward run a request's datums as right-padded batches of at most
`[tinker] batch_tokens` padded tokens (of similar lengths: padding costs compute like a
real token), not one by one: a datum at a time was 80% of a cookbook RL step
(bench/results_tinker.md). Right padding leaves each datum's real
positions as they were alone, so the outputs are the one-by-one path's within float32
rounding (tests/unit/tinker/test_model_batches.py); the budget bounds the float32
logits, the largest tensor of a pass.

Without `[tinker] engines` the sampler runs here, on the model thread; with them,
the engines sample (engines.py) and this model only trains and hands over copies of
an adapter's tensors (`adapter_tensors`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from services.tinker import losses
from services.tinker.core import (
    MAX_PADDING,
    Datum,
    SampleSpec,
    TinkerUserError,
    datum_batches,
)

if TYPE_CHECKING:
    import torch

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length", the SDK's StopReason


@dataclass
class _Adapter:
    name: str  # PEFT's adapter name (model ids hold ':', which PEFT's module names cannot)
    scratch: str  # the same-shaped adapter a snapshot of this one is sampled through
    optimizer: Any  # torch.optim.AdamW over this adapter's parameters
    lora: tuple[int, bool, bool, bool]  # rank, attn, mlp, unembed: what a saved state records
    steps: int = 0  # optim_steps applied (counted here, on the model thread, for save_state)


class AdapterModel:
    def __init__(
        self,
        model_dir: Path,
        lora_alpha: float,
        seed: int = 0,
        batch_tokens: int = 4096,
        max_padding: float = MAX_PADDING,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.base.eval()  # no dropout anywhere: the adapters run with dropout 0
        self.base.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = int(self.base.config.vocab_size)
        self.eos_ids = _eos_ids(self.base, self.tokenizer)
        self.lora_alpha = lora_alpha
        self.batch_tokens = batch_tokens  # [tinker] batch_tokens: padded tokens per forward
        self.max_padding = max_padding  # the share of a batch's tokens that may be padding
        # `cache` in the transformers that renamed it (5.x), `past_key_values` before.
        forward_params = inspect.signature(self.base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self.peft: Any = None  # peft.PeftModel once the first adapter exists
        self._adapters: dict[str, _Adapter] = {}
        self._snapshots: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        self._names = itertools.count(1)
        self._seeds = itertools.count(seed)

    # -- adapters ---------------------------------------------------------------------

    def add_adapter(
        self, model_id: str, rank: int, seed: int | None, attn: bool, mlp: bool, unembed: bool
    ) -> None:
        import torch
        from peft import LoraConfig, get_peft_model

        present = {n.rsplit(".", 1)[-1] for n, _ in self.base.named_modules()}
        wanted = (ATTN if attn else ()) + (MLP if mlp else ()) + (UNEMBED if unembed else ())
        targets = [m for m in wanted if m in present]
        if not targets:
            raise TinkerUserError(
                f"lora_config trains none of this model's modules (asked {wanted or 'none'})"
            )
        cfg = LoraConfig(
            r=rank, lora_alpha=self.lora_alpha,  # type: ignore[arg-type]  # PEFT types it int
            lora_dropout=0.0, target_modules=targets,
            bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip
        n = next(self._names)
        name, scratch = f"a{n}", f"a{n}_sampler"
        with warnings.catch_warnings(), torch.random.fork_rng():
            # A tied head with an adapter of its own is what train_unembed asks for.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            torch.manual_seed(seed if seed is not None else next(self._seeds))
            if self.peft is None:
                self.peft = get_peft_model(self.base, cfg, adapter_name=name)
            else:
                self.peft.add_adapter(name, cfg)
            self.peft.add_adapter(scratch, cfg)
        self._adapters[model_id] = _Adapter(
            name, scratch, self._new_optimizer(name), (rank, attn, mlp, unembed)
        )

    def _new_optimizer(self, name: str) -> Any:
        import torch

        # named_parameters' order is fixed by the LoRA shape: a saved optimizer state
        # (keyed by position) lines up with any adapter of the same shape.
        params = [p for n_, p in self.peft.named_parameters() if f".{name}." in n_]
        return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)

    def lora_shape(self, model_id: str) -> tuple[int, bool, bool, bool]:
        return self._adapters[model_id].lora

    def export_state(self, model_id: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
        """Copies of the adapter's tensors (named without the adapter's name) and of its
        optimizer's state_dict, and its step count, as they are now (save_state)."""
        import copy

        adapter = self._adapters[model_id]
        tensors = self.adapter_tensors(model_id)
        return tensors, copy.deepcopy(adapter.optimizer.state_dict()), adapter.steps

    def adapter_tensors(self, model_id: str) -> dict[str, torch.Tensor]:
        """Copies of the adapter's tensors as they are now, under PEFT's saved names
        (`base_model.model.<module>.lora_A.weight`: without the adapter's name)."""
        tag = f".{self._adapters[model_id].name}."
        return {
            n.replace(tag, "."): p.detach().clone()
            for n, p in self.peft.named_parameters()
            if tag in n
        }

    def import_state(
        self,
        model_id: str,
        tensors: dict[str, torch.Tensor],
        optimizer: dict[str, Any] | None,
        steps: int,
    ) -> None:
        """Load a saved state's tensors into the adapter; its optimizer state too, or
        (None) a fresh AdamW, as load_state without the optimizer means."""
        import torch

        adapter = self._adapters[model_id]
        tag = f".{adapter.name}."
        params = {n.replace(tag, "."): p for n, p in self.peft.named_parameters() if tag in n}
        if set(params) != set(tensors):
            missing = sorted(set(params) ^ set(tensors))[:3]
            raise TinkerUserError(
                f"the saved state's adapter does not fit this model's ({missing} differ)"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[n])
        fresh = self._new_optimizer(adapter.name)
        if optimizer is not None:
            fresh.load_state_dict(optimizer)
        adapter.optimizer, adapter.steps = fresh, steps

    def gradients(self, model_id: str) -> dict[str, torch.Tensor]:
        """Copies of the adapter's accumulated gradients (a forward_backward's not yet
        stepped), under adapter_tensors' names; empty when there are none."""
        tag = f".{self._adapters[model_id].name}."
        return {
            n.replace(tag, "."): p.grad.detach().clone()
            for n, p in self.peft.named_parameters()
            if tag in n and p.grad is not None
        }

    def set_gradients(self, model_id: str, grads: dict[str, torch.Tensor]) -> None:
        """Put back what `gradients` copied (a replay checkpoint's), so the next
        backward accumulates on them as it would have."""
        tag = f".{self._adapters[model_id].name}."
        for n, p in self.peft.named_parameters():
            if tag in n:
                saved = grads.get(n.replace(tag, "."))
                p.grad = None if saved is None else saved.clone()

    def snapshots(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every in-process sampler snapshot by key, under adapter_tensors' names."""
        return {
            key: {n.replace(f".{scratch}.", "."): t for n, t in tensors.items()}
            for key, (scratch, tensors) in self._snapshots.items()
        }

    def import_snapshot(self, model_id: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """A sampler snapshot of `model_id`'s adapter under `key`, from `snapshots`' form."""
        scratch = self._adapters[model_id].scratch
        tag = f".{scratch}."
        self._snapshots[key] = (
            scratch,
            {
                n: tensors[n.replace(tag, ".")].clone()
                for n, _ in self.peft.named_parameters()
                if tag in n
            },
        )

    def _activate(self, model_id: str) -> Any:
        adapter = self._adapters[model_id]
        self.peft.set_adapter(adapter.name)
        return adapter

    # -- training ---------------------------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        loss: str,
        data: list[Datum],
        backward: bool,
        config: dict[str, float] | None = None,
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum: the target tokens' logprobs and the per-token loss; the summed loss.
        With `backward`, the loss's gradients accumulate on the adapter until optim_step.
        The datums run as padded batches of at most `batch_tokens` tokens, little padded
        (core.datum_batches)."""
        self._activate(model_id)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        datum_losses = [0.0] * len(data)
        lengths = [len(d.tokens) for d in data]
        for batch in datum_batches(lengths, self.batch_tokens, self.max_padding):
            results = self._batch_pass(loss, [data[i] for i in batch], backward, config)
            for i, (target_lp, per_token, datum_loss) in zip(batch, results, strict=True):
                outputs[i] = {"logprobs": target_lp, "elementwise_loss": per_token}
                datum_losses[i] = datum_loss
        return outputs, {"loss:sum": sum(datum_losses)}  # summed in the request's order

    def _batch_pass(
        self, loss: str, batch: list[Datum], backward: bool, config: dict[str, float] | None
    ) -> list[tuple[np.ndarray, np.ndarray, float]]:
        """One forward (and backward) of `batch`, right-padded into one [B, N] tensor:
        per datum its target logprobs, per-token loss and summed loss.

        Right padding keeps every real position as it was alone: a datum's padding
        comes after its tokens, where causal attention never looks, the attention mask
        takes it out of the keys besides, and position ids count from 0 as they do alone.
        A batch with no padding (one datum, or equal lengths) runs without a mask, as one
        datum always ran."""
        import torch

        lengths = [len(d.tokens) for d in batch]
        n = max(lengths)
        ids = torch.zeros(len(batch), n, dtype=torch.long)  # [B, N], padded with id 0
        targets = torch.zeros(len(batch), n, dtype=torch.long)  # [B, N]
        for row, (d, k) in enumerate(zip(batch, lengths, strict=True)):
            ids[row, :k] = torch.tensor(d.tokens)
            targets[row, :k] = torch.tensor(d.inputs["target_tokens"], dtype=torch.long)
        real = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]
        mask = None if min(lengths) == n else real.long()
        with torch.set_grad_enabled(backward):
            # float32 logits [B, N, V]: the batch's largest tensor, which batch_tokens bounds.
            logits = self.peft(input_ids=ids, attention_mask=mask).logits.float()
            target_lp = torch.log_softmax(logits, -1).gather(2, targets[..., None])[..., 0]
            del logits  # target_lp [B, N]; autograd keeps the log-softmax its backward needs
            per_token = [
                losses.elementwise(loss, target_lp[row, :k], d.inputs, config)  # [k]
                for row, (d, k) in enumerate(zip(batch, lengths, strict=True))
            ]
            datum_loss = [t.sum() for t in per_token]
            if backward:
                torch.stack(datum_loss).sum().backward()
        return [
            (
                target_lp[row, :k].detach().numpy().astype(np.float32),
                per_token[row].detach().numpy().astype(np.float32),
                float(datum_loss[row].detach()),
            )
            for row, k in enumerate(lengths)
        ]

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step on the adapter's accumulated gradients, then zero them."""
        import torch

        opt = self._adapters[model_id].optimizer
        group = opt.param_groups[0]
        group["lr"] = adam.get("learning_rate", 1e-4)
        group["betas"] = (adam.get("beta1", 0.9), adam.get("beta2", 0.95))
        group["eps"] = adam.get("eps", 1e-12)
        group["weight_decay"] = adam.get("weight_decay", 0.0)
        clip = adam.get("grad_clip_norm", 0.0)
        params = [p for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self._adapters[model_id].steps += 1
        return {"grad_norm:mean": float(norm)}

    # -- sampling ---------------------------------------------------------------------

    def snapshot(self, model_id: str, key: str) -> None:
        """Keep the adapter's weights as they are now, under `key` (a sampling session)."""
        adapter = self._adapters[model_id]
        tag = f".{adapter.name}."
        tensors = {
            n.replace(tag, f".{adapter.scratch}."): p.detach().clone()
            for n, p in self.peft.named_parameters()
            if tag in n
        }
        self._snapshots[key] = (adapter.scratch, tensors)

    def _use_snapshot(self, key: str | None) -> contextlib.AbstractContextManager[Any]:
        import torch

        if key is None:  # the base model
            return (
                self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()
            )
        scratch, tensors = self._snapshots[key]
        params = dict(self.peft.named_parameters())
        with torch.no_grad():
            for n, t in tensors.items():
                params[n].copy_(t)
        self.peft.set_adapter(scratch)
        return contextlib.nullcontext()

    def sample(
        self, snapshot: str | None, spec: SampleSpec
    ) -> tuple[list[Sequence], list[float] | None]:
        """`num_samples` continuations of the prompt (with each sampled token's logprob
        from the raw logits) and, if asked, the prompt's logprobs (NaN at position 0)."""
        import torch

        model = self.peft if self.peft is not None else self.base
        seed = spec.seed if spec.seed is not None else next(self._seeds)
        gen = torch.Generator().manual_seed(seed)
        n = spec.num_samples
        from transformers import DynamicCache

        cache = {self._cache_kwarg: DynamicCache()}  # filled in place, step by step
        with torch.no_grad(), self._use_snapshot(snapshot):
            out = model(input_ids=torch.tensor([spec.prompt] * n), use_cache=True, **cache)
            prompt_lp = None
            if spec.prompt_logprobs:
                lp = torch.log_softmax(out.logits[0, :-1].float(), -1)  # [P-1, V]
                nxt = torch.tensor(spec.prompt[1:])[:, None]
                prompt_lp = [math.nan, *lp.gather(1, nxt)[:, 0].tolist()]
            seqs = [Sequence([], [], "length") for _ in range(n)]
            live = list(range(n))
            logits = out.logits[:, -1].float()  # [n, V]
            for _ in range(spec.max_tokens):
                chosen = _pick(logits, spec, gen)  # [n]
                lp = torch.log_softmax(logits, -1).gather(1, chosen[:, None])[:, 0]
                for i in list(live):
                    tok = int(chosen[i])
                    seqs[i].tokens.append(tok)
                    seqs[i].logprobs.append(float(lp[i]))
                    if self._stops(seqs[i].tokens, spec):
                        seqs[i].stop_reason = "stop"
                        live.remove(i)
                if not live:
                    break
                out = model(input_ids=chosen[:, None], use_cache=True, **cache)
                logits = out.logits[:, -1].float()
        return seqs, prompt_lp

    def _stops(self, tokens: list[int], spec: SampleSpec) -> bool:
        stop_ids = self.eos_ids if spec.stop_tokens is None else set(spec.stop_tokens)
        if tokens[-1] in stop_ids:
            return True
        if spec.stop_strings:
            tail = str(self.tokenizer.decode(tokens[-16:]))
            return any(tail.endswith(s) for s in spec.stop_strings)
        return False


def _pick(logits: torch.Tensor, spec: SampleSpec, gen: torch.Generator) -> torch.Tensor:
    """The next token per row [n] from logits [n, V]: greedy at temperature 0, else
    temperature, then top-k, then top-p (nucleus) on the scaled distribution."""
    import torch

    if spec.temperature == 0:
        return logits.argmax(-1)
    scaled = logits / spec.temperature
    if spec.top_k > 0:
        kth = torch.topk(scaled, min(spec.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if spec.top_p < 1:
        sorted_, order = torch.sort(scaled, descending=True, dim=-1)
        probs = torch.softmax(sorted_, -1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= spec.top_p
        sorted_ = sorted_.masked_fill(drop, -math.inf)
        scaled = torch.full_like(scaled, -math.inf).scatter(-1, order, sorted_)
    return torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen)[:, 0]


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    out = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return out

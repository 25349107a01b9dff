"""Train batches, their token layout, and micro-batch planning.

Layout. A sample is prompt p (P tokens) then response r (R tokens); the
model sees x = p ++ r (T = P + R tokens) and position j of the logits
predicts x[j + 1]. Every per-token quantity (loss mask, logprobs, weights,
advantages) therefore lives on the T - 1 *target positions*, and response
token k sits at target position P - 1 + k. Prompt positions carry mask 0.

Planning. Samples are split over ranks (balanced by tokens, longest first)
and each rank's share into micro-batches under a token budget: packed into
one row each (core/packing.py, the default), or here as padded rows whose
size rows × longest row stays under the budget. Because aggregation is a
fixed per-token weight computed from the whole batch (see `loss.py`), how
samples are split never changes the loss or gradient, only the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.runtime.errors import FlywheelError


class BatchError(FlywheelError, ValueError):
    """A train batch is malformed; names the sample and field."""

    def __init__(self, message: str, *, sample: int | None = None, field: str | None = None):
        super().__init__(message)
        self.sample = sample
        self.field = field


@dataclass
class TensorBatch:
    """One RL train batch, as the trainer service hands it to `Trainer.train_step`.

    Lists hold one 1-D tensor per sample. `loss_mask` (per response token,
    1 = train on it) is None when every response token counts; multi-turn
    samples set tool/environment tokens to 0.
    """

    prompt_ids: list[torch.Tensor]  # each [P_i] int64
    response_ids: list[torch.Tensor]  # each [R_i] int64
    rollout_logprobs: list[torch.Tensor]  # each [R_i] float32, the engine's logprobs
    rewards: torch.Tensor  # [N] float32
    group_ids: torch.Tensor  # [N] int64, samples of one prompt share an id
    truncated: torch.Tensor  # [N] bool, hit the length limit
    loss_mask: list[torch.Tensor] | None = None  # each [R_i] 0/1
    temperature: float = 1.0
    # each [R_i] int64: the weight version that generated each response token,
    # -1 where unknown (the train–inference mismatch compares same-version tokens)
    token_versions: list[torch.Tensor] | None = None
    # each [R_i] float32: the teacher's logprob of each response token (distillation);
    # None for a sample no teacher scored, or the whole list when none was
    teacher_logprobs: list[torch.Tensor | None] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def validate(self) -> None:
        """Raise BatchError naming the first inconsistent sample/field."""
        n = len(self)
        for name in ("response_ids", "rollout_logprobs"):
            if len(getattr(self, name)) != n:
                raise BatchError(
                    f"{name} has {len(getattr(self, name))} samples, want {n}", field=name
                )
        for name in ("rewards", "group_ids", "truncated"):
            if getattr(self, name).shape != (n,):
                raise BatchError(f"{name} must have shape ({n},)", field=name)
        if self.temperature <= 0:
            raise BatchError("temperature must be > 0", field="temperature")
        for i in range(n):
            r = self.response_ids[i].numel()
            if self.prompt_ids[i].numel() < 1:
                raise BatchError("empty prompt", sample=i, field="prompt_ids")
            if self.rollout_logprobs[i].numel() != r:
                raise BatchError(
                    "rollout_logprobs length != response length", sample=i, field="rollout_logprobs"
                )
            if self.loss_mask is not None and self.loss_mask[i].numel() != r:
                raise BatchError("loss_mask length != response length", sample=i, field="loss_mask")


def split_groups(batch: TensorBatch, parts: int) -> list[TensorBatch]:
    """`batch` as up to `parts` mini-batches of whole groups (for several optimizer
    steps per batch, PPO-style). A group is never split: its advantages are
    relative to its own samples."""
    order = list(dict.fromkeys(batch.group_ids.tolist()))  # group ids, first-seen order
    parts = max(1, min(parts, len(order)))
    if parts == 1:
        return [batch]
    chunks = [order[i::parts] for i in range(parts)]
    out = []
    for chunk in chunks:
        keep = set(chunk)
        idx = [i for i, g in enumerate(batch.group_ids.tolist()) if g in keep]
        out.append(
            TensorBatch(
                prompt_ids=[batch.prompt_ids[i] for i in idx],
                response_ids=[batch.response_ids[i] for i in idx],
                rollout_logprobs=[batch.rollout_logprobs[i] for i in idx],
                rewards=batch.rewards[idx],
                group_ids=batch.group_ids[idx],
                truncated=batch.truncated[idx],
                loss_mask=[batch.loss_mask[i] for i in idx]
                if batch.loss_mask is not None
                else None,
                temperature=batch.temperature,
                token_versions=[batch.token_versions[i] for i in idx]
                if batch.token_versions is not None
                else None,
                teacher_logprobs=[batch.teacher_logprobs[i] for i in idx]
                if batch.teacher_logprobs is not None
                else None,
            )
        )
    return out


def response_positions(prompt_len: int, response_len: int) -> slice:
    """Target positions of the response tokens (see the module docstring)."""
    return slice(prompt_len - 1, prompt_len - 1 + response_len)


def layout_sample(
    prompt: torch.Tensor, response: torch.Tensor, per_token: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One sample as a row: input_ids [T] and each per-response-token field on [T - 1]."""
    input_ids = torch.cat([prompt.long(), response.long()])  # [T]
    span = response_positions(prompt.numel(), response.numel())
    row = {"input_ids": input_ids}
    for name, values in per_token.items():
        full = torch.zeros(input_ids.numel() - 1, dtype=values.dtype)
        full[span] = values
        row[name] = full
    return row


def collate(rows: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows into [B, T] tensors (+ attention_mask and targets [B, T - 1]).

    Per-token fields are padded with 0, so padding carries no loss weight.
    """
    t = max(r["input_ids"].numel() for r in rows)
    out: dict[str, torch.Tensor] = {}
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), t), dtype=torch.long)
    for b, r in enumerate(rows):
        n = r["input_ids"].numel()
        ids[b, :n] = r["input_ids"]
        attn[b, :n] = 1
    out["input_ids"], out["attention_mask"], out["targets"] = ids, attn, ids[:, 1:]
    for name in rows[0]:
        if name == "input_ids":
            continue
        col = torch.zeros((len(rows), t - 1), dtype=rows[0][name].dtype)
        for b, r in enumerate(rows):
            col[b, : r[name].numel()] = r[name]
        out[name] = col
    return out


def shard_for_ranks(costs: list[int], world_size: int) -> list[list[int]]:
    """Split sample indices over ranks, balancing total cost (longest first, greedy).

    Deterministic: every rank computes the same split from the same batch.
    """
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda k: (loads[k], k))
        shards[rank].append(i)
        loads[rank] += costs[i]
    return [sorted(s) for s in shards]


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group indices so each group's padded size rows × max_len <= token_budget.

    Longest first, so rows of similar length share a micro-batch (little
    padding). A sample longer than the budget gets a micro-batch of its own.
    """
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if current and (len(current) + 1) * width > token_budget:
            groups.append(current)
            current = []
        if not current:
            width = lengths[i]
        current.append(i)
    if current:
        groups.append(current)
    return groups


# Sums that are means over a subset of the loss tokens: key -> the sum counting that
# subset. Absent from the metrics (with the subset's maxima) when the subset is empty.
MEAN_OVER = {"mismatch_abs_mean": "mismatch_tokens", "mismatch_k3": "mismatch_tokens"}
SUBSET_MAXES = {"mismatch_abs_max": "mismatch_tokens"}


@dataclass
class MetricAccumulator:
    """Combines `LossOutput`s of micro-batches (and ranks) into batch metrics."""

    tokens: float = 0.0
    loss: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)

    def add(self, out) -> None:  # out: LossOutput
        self.tokens += float(out.tokens)
        self.loss += float(out.loss.detach())
        for k, v in out.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        for k, v in out.parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + float(v)
        for k, v in out.maxes.items():
            self.maxes[k] = max(self.maxes.get(k, float("-inf")), float(v))

    def as_tensors(self) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
        """(sum-reduced vector, max-reduced vector, their keys) for all-reduce."""
        sum_keys = ["tokens", "loss", *sorted(self.sums), *sorted(self.parts)]
        vals = [self.tokens, self.loss]
        vals += [self.sums[k] for k in sorted(self.sums)]
        vals += [self.parts[k] for k in sorted(self.parts)]
        max_keys = sorted(self.maxes)
        return (
            torch.tensor(vals, dtype=torch.float64),
            torch.tensor([self.maxes[k] for k in max_keys], dtype=torch.float64),
            sum_keys,
            max_keys,
        )

    def finalize(self, summed: torch.Tensor, maxed: torch.Tensor, sum_keys, max_keys) -> dict:
        """Metrics dict: loss, per-token means of `sums`, `parts` as is, maxima."""
        s = dict(zip(sum_keys, summed.tolist(), strict=True))
        tokens = max(s["tokens"], 1.0)
        metrics = {"loss": s["loss"], "tokens": s["tokens"]}
        for k in self.sums:
            if k in MEAN_OVER:
                if s[MEAN_OVER[k]] > 0:
                    metrics[k] = s[k] / s[MEAN_OVER[k]]
            else:
                metrics[k] = s[k] / tokens
        for k in self.parts:
            metrics[k] = s[k]
        for k, v in zip(max_keys, maxed.tolist(), strict=True):
            if k not in SUBSET_MAXES or s.get(SUBSET_MAXES[k], 0.0) > 0:
                metrics[k] = v
        return metrics

"""One forward pass of a micro-batch: per-token logprobs (and entropies) of its targets.

Three layouts come in (core/batching.py padded rows, core/packing.py packed
rows, core/prefix.py prefix-shared trees, whose per-token fields are
entries that read the hidden state at `hidden_index`) and two ways of
getting logprobs out:

- 'full': the model's own logits [B, T, V], then core/logprobs.py. Works
  for any causal LM; holds [T × V] floats several times over.
- 'chunked': the model runs as usual (its root forward, so FSDP2's hooks,
  activation checkpointing and attention all behave as they always do),
  but for the duration of the call its LM head is replaced by a function
  that takes the final hidden states, keeps only the positions that carry
  loss (prompt and pad positions never touch the head) and computes their
  logprobs/entropies chunk by chunk (`chunked_token_stats`). Only models
  whose head is a plain `lm_head(hidden)` qualify (model.check_plain_head).

Under single-process bf16 the forward runs in autocast (float32 master
weights); under FSDP2 the MixedPrecisionPolicy already computes in bf16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.trainer.core.logprobs import (
    chunk_rows,
    chunked_token_stats,
    token_entropy,
    token_logprobs,
)
from services.trainer.core.prefix import VIEW_KEYS
from services.trainer.lora import head_parameters

MicroBatch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardSpec:
    """How forwards run: logprob implementation, chunk size, autocast, varlen attention."""

    logprobs: str = "chunked"  # 'chunked' | 'full'
    chunk_mib: float = 256.0
    autocast: torch.dtype | None = None  # bf16 in one process; None: run as the params are
    varlen: bool = False  # packed rows carry cu_seqlens for the varlen attention kernel


def token_stats(
    model: torch.nn.Module,
    mb: MicroBatch,
    spec: ForwardSpec,
    device: torch.device,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp, entropy or None) on the micro-batch's target positions (the fields' shape).

    Positions with `loss_mask` 0 get logp 0 under 'chunked' (nothing
    downstream reads them: their weight and mask are 0).
    """
    inputs = model_inputs(mb, device, spec.varlen)
    with _autocast(device, spec.autocast):
        if spec.logprobs == "full":
            targets = mb["targets"].to(device)
            logits = model(**inputs).logits
            if "hidden_index" in mb:  # trees: each entry's logits, [1, E, V]
                logits = logits.index_select(1, mb["hidden_index"][0].to(device))
            elif logits.shape[1] != targets.shape[1]:  # padded: position j predicts j + 1
                logits = logits[:, :-1]
            logp = token_logprobs(logits, targets, temperature)
            return logp, (token_entropy(logits, temperature) if entropy else None)
        # Which positions reach the head is decided on the CPU copy: no device sync.
        select = mb["loss_mask"] > 0
        return _chunked(
            model,
            inputs,
            mb["targets"],
            select,
            device,
            temperature,
            entropy,
            spec.chunk_mib,
            mb.get("hidden_index"),
        )


def model_inputs(mb: MicroBatch, device: torch.device, varlen: bool) -> dict:
    """Keyword arguments of the model's forward for a padded or a packed micro-batch."""
    # No KV cache: training never decodes, and with a cache transformers ignores packing.
    inputs: dict = {"input_ids": mb["input_ids"].to(device), "use_cache": False}
    if "position_ids" not in mb:  # padded rows
        return {**inputs, "attention_mask": mb["attention_mask"].to(device)}
    # Packed: no 2-D mask, so transformers reads the boundaries from the position ids.
    inputs["position_ids"] = mb["position_ids"].to(device)
    if "view_q" in mb:  # prefix-shared trees: the attention reads the views
        inputs["flywheel_views"] = {k: mb[k].to(device) for k in VIEW_KEYS}
    elif varlen:
        cu = mb["cu_seqlens"].to(device)
        longest = int(mb["max_len"])
        inputs.update(
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest
        )
    return inputs


def _chunked(
    model: torch.nn.Module,
    inputs: dict,
    targets: torch.Tensor,  # [B, T'] on CPU, T' = T (packed) or T - 1 (padded)
    select: torch.Tensor,  # [B, T'] bool on CPU: positions whose logprob is needed
    device: torch.device,
    temperature: float,
    entropy: bool,
    chunk_mib: float,
    hidden_index: torch.Tensor | None = None,  # [1, E] (trees): the hidden state of each entry
) -> tuple[torch.Tensor, torch.Tensor | None]:
    b, width = targets.shape
    t = inputs["input_ids"].shape[1]
    if hidden_index is not None:  # trees: entries, not positions; the scatter is over entries
        t = width
    elif width != t:  # padded: the last position predicts nothing
        select = torch.nn.functional.pad(select, (0, t - width))
        targets = torch.nn.functional.pad(targets, (0, t - width))
    flat_idx = select.reshape(-1).nonzero().squeeze(1)  # [N] flat positions that carry loss
    picked = targets.reshape(-1).index_select(0, flat_idx).to(device, non_blocking=True)  # [N]
    idx = flat_idx.to(device, non_blocking=True)
    # Which hidden state each of them reads: its own position, or (trees) its entry's.
    reads = idx if hidden_index is None else hidden_index.reshape(-1)[flat_idx].to(device)
    head = model.get_output_embeddings()  # type: ignore[operator]
    got: dict[str, torch.Tensor | None] = {}

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [N]
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, reads)  # [N, H]
        weight, bias = head_parameters(head)  # with a LoRA head: W + s·B@A
        rows = chunk_rows(weight.shape[0], chunk_mib)
        lp, got["entropy"] = chunked_token_stats(
            flat, weight, picked, temperature, bias=bias, entropy=entropy, rows=rows
        )
        got["logp"] = lp
        return lp  # what the model returns as "logits": the graph's output

    with _head_replaced(head, head_forward):
        model(**inputs)
    logp, ent = got["logp"], got["entropy"]
    assert logp is not None
    return _scatter(logp, idx, b, t)[:, :width], (
        None if ent is None else _scatter(ent, idx, b, t)[:, :width]
    )


def _scatter(values: torch.Tensor, idx: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """[N] values at flat positions `idx` of a zero [b, t] tensor (differentiable)."""
    return values.new_zeros(b * t).index_copy(0, idx, values).view(b, t)


@contextlib.contextmanager
def _head_replaced(head: torch.nn.Module, forward) -> Iterator[None]:
    """`head(x)` calls `forward(x)` inside the block (an instance attribute shadows the method)."""
    had = "forward" in head.__dict__  # e.g. a hook library's wrapper: put it back after
    previous = head.__dict__.get("forward")
    setattr(head, "forward", forward)  # noqa: B010 (mypy refuses assigning a method)
    try:
        yield
    finally:
        if had:
            setattr(head, "forward", previous)  # noqa: B010
        else:
            del head.forward


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)

"""Sequence packing: micro-batches as one row of whole sequences, no padding.

Padding a micro-batch to its longest row spends compute and memory on pad
tokens; with RL's mixed response lengths that is often most of it. Packing
concatenates whole sequences into one row of at most `micro_batch_tokens`
tokens (first-fit decreasing, deterministic), with position ids that
restart at 0 for every sequence. Attention must not cross sequences: the
model sees the boundaries either through those position ids (transformers
builds a block-diagonal causal mask for sdpa/eager when the 2-D attention
mask is None) or through `cu_seqlens` (a varlen attention kernel on GPU,
services/trainer/attention.py).

Layout of a packed micro-batch of sequences x_1 … x_k (lengths T_i, S = ΣT_i):
input_ids, position_ids and seq_ids are [1, S]. Per-token fields live on
*all* S positions: sequence i's T_i - 1 target positions (see
batching.py) followed by one boundary slot whose target would be the next
sequence's first token; every field is 0 there (no loss weight, masked),
so it never counts. `targets` [1, S] is input_ids shifted left by one.
`cu_seqlens` [k + 1] (int32) and `max_len` are what varlen kernels need.
"""

from __future__ import annotations

import torch


def plan_packed(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group indices so each group's total length is <= token_budget (first-fit decreasing).

    A sequence longer than the budget gets a group of its own. Deterministic.
    """
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, load in enumerate(loads):
            if load + lengths[i] <= token_budget:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return groups


def collate_packed(rows: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows (input_ids [T_i], fields [T_i - 1]) as one packed row (see the module docstring)."""
    lengths = [r["input_ids"].numel() for r in rows]
    pad = torch.tensor([pad_id], dtype=torch.long)
    ids = torch.cat([r["input_ids"].long() for r in rows])  # [S]
    out: dict[str, torch.Tensor] = {
        "input_ids": ids[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "seq_ids": torch.cat([torch.full((n,), j) for j, n in enumerate(lengths)])[None],
        "targets": torch.cat([torch.cat([r["input_ids"][1:].long(), pad]) for r in rows])[None],
        "cu_seqlens": torch.tensor(
            [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32
        ),
        "max_len": torch.tensor(max(lengths)),
    }
    for name in rows[0]:
        if name == "input_ids":
            continue
        zero = torch.zeros(1, dtype=rows[0][name].dtype)
        out[name] = torch.cat([torch.cat([r[name], zero]) for r in rows])[None]
    return out

"""A left-padded batched KV cache and the three operations continuous batching needs.

Layout. Every layer holds keys and values [B, H_kv, T, D]; `mask` [B, T] is 1
where a row has a real token. Rows are right-aligned (left-padded): row r's
`lengths[r]` real tokens occupy the last `lengths[r]` columns, so one decode
step appends one column for every row, and a row's next position id is simply
its length. This is the layout Hugging Face `generate` uses for left-padded
batches, so the model's own masking and rotary code handle it unchanged.

- `join`:  a freshly prefilled group joins between decode steps: the shorter
  cache is left-padded with zeros to the longer one's T, then rows are
  concatenated (one copy of the cache per join, not per step).
- `select`: finished rows leave (index_select on the batch dimension).
- `trim`:  columns that are padding in every row are dropped, so T stays the
  longest live row rather than growing with the engine's uptime.

Padding columns are zeroed (`zero_padding`): a fully masked query row can
produce NaN in attention, and 0 * NaN would leak through the masked softmax
weights into real rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class KVBatch:
    """Per-layer (keys, values) [B, H, T, D], mask [B, T] (int64), lengths [B] (int64)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    lengths: torch.Tensor

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    import torch

    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def zero_padding(kv: KVBatch) -> KVBatch:
    """Zero keys/values in padding columns (see module docstring)."""
    keep = kv.mask[:, None, :, None].to(kv.layers[0][0].dtype)  # [B, 1, T, 1]
    kv.layers = [(k * keep, v * keep) for k, v in kv.layers]
    return kv


def join(a: KVBatch | None, b: KVBatch) -> KVBatch:
    """Rows of `a` followed by rows of `b`, both right-aligned to a common width."""
    import torch

    if a is None or a.batch == 0:
        return b
    width = max(a.width, b.width)
    layers = [
        (
            torch.cat([_left_pad(ka, width, 2), _left_pad(kb, width, 2)], dim=0),
            torch.cat([_left_pad(va, width, 2), _left_pad(vb, width, 2)], dim=0),
        )
        for (ka, va), (kb, vb) in zip(a.layers, b.layers, strict=True)
    ]
    mask = torch.cat([_left_pad(a.mask, width, 1), _left_pad(b.mask, width, 1)], dim=0)
    return KVBatch(layers, mask, torch.cat([a.lengths, b.lengths]))


def select(kv: KVBatch, rows: list[int]) -> KVBatch | None:
    """Keep only `rows` (in that order), then trim; None when no row is left."""
    import torch

    if not rows:
        return None
    if rows == list(range(kv.batch)):
        return kv
    idx = torch.tensor(rows, dtype=torch.long)
    layers = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv.layers]
    return trim(KVBatch(layers, kv.mask.index_select(0, idx), kv.lengths.index_select(0, idx)))


def trim(kv: KVBatch) -> KVBatch:
    """Drop leading columns that are padding in every row (T becomes max(lengths))."""
    width = int(kv.lengths.max())
    start = kv.width - width
    if start <= 0:
        return kv
    layers = [(k[:, :, start:, :], v[:, :, start:, :]) for k, v in kv.layers]
    return KVBatch(layers, kv.mask[:, start:], kv.lengths)


def left_pad_ids(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align token id lists: (ids [B, L], mask [B, L]) with L the longest."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[row, width - len(s) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, L] for a right-aligned mask: 0.. over real tokens, 0 on padding."""
    return (mask.cumsum(-1) - 1).clamp(min=0)

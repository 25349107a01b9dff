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
- `stack_prefixes` / `right_align`: the prefix cache's two moves. Rows whose
  prompts start with a cached prefix get that prefix's KV as a right-aligned
  past; their remaining tokens run on top of it (left-padded themselves), which
  leaves padding between each row's past and its new columns; `right_align`
  gathers every row's real columns back to the right edge.

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


Layers = list[tuple["torch.Tensor", "torch.Tensor"]]
"""Per-layer (keys, values) of one sequence: [1, H, T, D] each."""


def stack_prefixes(rows: list[tuple[Layers | None, int]]) -> KVBatch:
    """A right-aligned batch of leading KV: row r holds the first n_r positions of its
    layers (none where n_r is 0). Always fresh tensors: a cached prefix is never handed
    to the model, which would append to it."""
    import torch

    width = max(n for _, n in rows)
    ref = next(layers for layers, n in rows if n and layers is not None)
    out: Layers = []
    for i, (k_ref, _) in enumerate(ref):
        empty = k_ref.new_zeros((1, k_ref.shape[1], width, k_ref.shape[3]))  # [1, H, W, D]
        ks, vs = [], []
        for layers, n in rows:
            if n == 0 or layers is None:
                ks.append(empty)
                vs.append(empty)
                continue
            k, v = layers[i]
            ks.append(_left_pad(k[:, :, :n, :], width, 2))
            vs.append(_left_pad(v[:, :, :n, :], width, 2))
        out.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))
    lengths = torch.tensor([n for _, n in rows], dtype=torch.long)  # [B]
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()  # [B, W]
    return KVBatch(out, mask, lengths)


def right_align(layers: Layers, mask: torch.Tensor) -> KVBatch:
    """Move every row's real columns (mask 1, in order) to the right edge; padding left."""
    import torch

    lengths = mask.sum(-1)  # [B]
    width = int(lengths.max())
    # A stable sort of the 0/1 mask puts padding columns first and keeps the real ones
    # in order; the last `width` indices are each row's real columns, left-padded.
    order = torch.sort(mask, dim=1, stable=True).indices[:, -width:]  # [B, W]
    idx = order[:, None, :, None]  # [B, 1, W, 1]
    aligned = [
        (
            k.gather(2, idx.expand(-1, k.shape[1], -1, k.shape[3])),
            v.gather(2, idx.expand(-1, v.shape[1], -1, v.shape[3])),
        )
        for k, v in layers
    ]
    return zero_padding(KVBatch(aligned, torch.gather(mask, 1, order), lengths))


def row_prefix(kv: KVBatch, row: int) -> Layers:
    """A copy of one row's real columns ([1, H, n, D] per layer), for the prefix cache
    (a copy, so the cache does not keep the whole batch's tensors alive)."""
    n = int(kv.lengths[row])
    return [
        (
            k[row : row + 1, :, kv.width - n :, :].clone(),
            v[row : row + 1, :, kv.width - n :, :].clone(),
        )
        for k, v in kv.layers
    ]


def nbytes(layers: Layers) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)

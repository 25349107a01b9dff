"""Attention over packed sequences, registered with transformers: a varlen flash kernel on
GPU, per-sequence attention on CPU.

Left to transformers, a packed row (position ids that restart per sequence,
no 2-D mask) goes through its sdpa path with a block-diagonal causal mask:
exact, but S² work and memory on a row of S tokens. Instead:

- GPU, half precision: PyTorch's `varlen_attn` (flash attention over
  `cu_seqlens`, cost Σ T_i², no mask tensor), as `flywheel_varlen`.
- CPU: `flywheel_segments` (packed rows are the CPU default in bf16 only:
  in float32 the packed step measured slower than padded rows,
  bench/results_real_profile.md). The projections and MLPs (nearly all of
  a step's FLOPs) run on the packed row, so no pad token is computed; only
  the attention itself lays the sequences out as a right-padded
  [k, H, T_max, D] block, runs one causal attention over it (a valid query
  never sees a pad key: causality stops it at its own position) and packs
  the result back. Its matmuls are in the autocast dtype when one is on,
  softmax in float32. (sdpa's CPU flash kernel on that block was not
  measured against these plain matmuls.)

Prefix-shared groups (core/prefix.py) come as *views* instead of sequences:
`view_attention` runs one masked attention per view (queries, their keys,
visibility by position id), on any device, for either registered name.

transformers passes the `cu_seq_lens_*` / `max_length_*` keyword arguments
(and `flywheel_views`) given to the model's forward down to every attention
call; that is where the boundaries come from.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

VARLEN = "flywheel_varlen"
SEGMENTS = "flywheel_segments"


def varlen_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `varlen_attn` can run here: CUDA, half precision, a torch that has it."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def register_varlen() -> str:
    """Register `flywheel_varlen` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, _varlen_attention)
    return VARLEN


def register_segments() -> str:
    """Register `flywheel_segments` (packed rows on CPU) with transformers; returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENTS, _segments_attention)
    return SEGMENTS


def _segments_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, S, D]
    key: torch.Tensor,  # [1, Hkv, S, D]
    value: torch.Tensor,  # [1, Hkv, S, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if sliding_window is not None or dropout:
        raise ValueError(f"{SEGMENTS} supports neither sliding windows nor attention dropout")
    if "flywheel_views" in kwargs:
        return view_attention(query, key, value, kwargs["flywheel_views"], scaling)
    if query.shape[0] != 1 or "cu_seq_lens_q" not in kwargs:
        raise ValueError(f"{SEGMENTS} needs one packed row and cu_seq_lens_q/max_length_q")
    cu = kwargs["cu_seq_lens_q"].to(torch.long)
    width = int(kwargs["max_length_q"])
    hq, s, d = query.shape[1], query.shape[2], query.shape[3]
    lengths = cu[1:] - cu[:-1]  # [k]
    k = lengths.numel()
    # Where each packed position sits in the padded block: sequence i, offset o -> i·width + o.
    seq = torch.repeat_interleave(torch.arange(k), lengths)  # [S]
    where = seq * width + torch.arange(s) - cu[:-1].index_select(0, seq)  # [S]
    # Under autocast RoPE hands q and k over in float32; the matmuls run in its dtype.
    cpu_autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if cpu_autocast else value.dtype

    def padded(x: torch.Tensor) -> torch.Tensor:  # [1, H, S, D] -> [k, H, width, D]
        h = x.shape[1]
        out = x.new_zeros((h, k * width, d), dtype=dtype)
        out = out.index_copy(1, where, x[0].to(dtype))
        return out.view(h, k, width, d).transpose(0, 1)

    q, kk, v = padded(query), padded(key), padded(value)
    if kk.shape[1] != hq:  # grouped-query attention: each key/value head serves hq / hkv
        rep = hq // kk.shape[1]
        kk, v = kk.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = scaling if scaling is not None else d**-0.5
    scores = torch.matmul(q, kk.transpose(-1, -2)).float() * scale  # [k, Hq, W, W]
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1).to(dtype)
    out = torch.matmul(probs, v)  # [k, Hq, W, D]
    flat = out.transpose(0, 1).reshape(hq, k * width, d).index_select(1, where)  # [Hq, S, D]
    return flat.transpose(0, 1)[None], None  # [1, S, Hq, D], as transformers' functions return


def view_attention(
    query: torch.Tensor,  # [1, Hq, S, D]
    key: torch.Tensor,  # [1, Hkv, S, D]
    value: torch.Tensor,  # [1, Hkv, S, D]
    views: dict[str, torch.Tensor],
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed row's views (core/prefix.py): view v's queries `view_q[v]`
    attend to its keys `view_k[v]` whose position id is not greater than theirs.

    The views are gathered into [m, H, W, D] blocks (index S: a zero row, padding), so
    the cost is the sum over views of Wq × Wk, with no [S × S] mask. Matmuls in the
    autocast dtype when one is on (either device), softmax in float32 (or float64).
    """
    dev = query.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
    m, wq = views["view_q"].shape
    hq, d = query.shape[1], query.shape[3]
    hkv = key.shape[1]

    def gather(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [1, H, S, D] -> [m, H, W, D]
        h = x[0].to(dtype)
        padded = torch.cat([h, h.new_zeros(h.shape[0], 1, d)], dim=1)  # [H, S + 1, D]
        return padded[:, at].transpose(0, 1)

    # Grouped-query attention by broadcasting: [m, Hkv, rep, Wq, D] against [m, Hkv, 1, Wk, D].
    q = gather(query, views["view_q"]).reshape(m, hkv, hq // hkv, wq, d)
    k = gather(key, views["view_k"])[:, :, None]
    v = gather(value, views["view_k"])[:, :, None]
    scale = scaling if scaling is not None else d**-0.5
    stat = torch.promote_types(dtype, torch.float32)  # float64 stays float64 (the tests)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(stat) * scale  # [m, Hkv, rep, Wq, Wk]
    hidden = views["view_k_pos"][:, None, :] > views["view_q_pos"][:, :, None]  # [m, Wq, Wk]
    probs = scores.masked_fill(hidden[:, None, None], float("-inf")).softmax(-1).to(dtype)
    out = torch.matmul(probs, v).reshape(m, hq, wq, d)  # [m, Hq, Wq, D]
    flat = out.transpose(0, 1).reshape(hq, m * wq, d).index_select(1, views["view_out"])
    return flat.transpose(0, 1)[None], None  # [1, S, Hq, D]


@functools.cache
def _kernel_params() -> frozenset[str]:
    """The keyword arguments this torch's `varlen_attn` takes (the API is young)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, S, D]
    key: torch.Tensor,  # [1, Hkv, S, D]
    value: torch.Tensor,  # [1, Hkv, S, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from torch.nn.attention.varlen import varlen_attn

    if sliding_window is not None or dropout:
        raise ValueError(f"{VARLEN} supports neither sliding windows nor attention dropout")
    if "flywheel_views" in kwargs:  # prefix-shared groups: no varlen kernel takes a tree
        return view_attention(query, key, value, kwargs["flywheel_views"], scaling)
    if query.shape[0] != 1 or "cu_seq_lens_q" not in kwargs:
        raise ValueError(f"{VARLEN} needs one packed row and cu_seq_lens_q/max_length_q")
    cu, max_len = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    # Under autocast, RoPE leaves q and k in float32 (sdpa would be cast by autocast;
    # this custom op is not), and the kernel takes half precision only.
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else value.dtype
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # [S, H, D]
    params = _kernel_params()
    extra: dict[str, Any] = (
        {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    )
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **extra)
    assert isinstance(out, torch.Tensor)  # no aux requested
    return out[None], None  # [1, S, Hq, D], as transformers' attention functions return

"""Attention over packed sequences on GPU: a varlen flash kernel, registered with transformers.

On CPU (and in float32) a packed row goes through transformers' own sdpa
path: with position ids that restart per sequence and no 2-D mask it builds
a block-diagonal causal mask, which is exact but spends S² work and memory
on a row of S tokens. On a GPU that is the wrong trade at 16k tokens, so
there the model's attention is PyTorch's `varlen_attn` (flash attention
over `cu_seqlens`, cost Σ T_i², no mask tensor), registered as the
attention implementation `flywheel_varlen`. transformers passes the
`cu_seq_lens_*` / `max_length_*` keyword arguments given to the model's
forward down to every attention call; that is where the boundaries come from.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

VARLEN = "flywheel_varlen"


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

    if query.shape[0] != 1 or "cu_seq_lens_q" not in kwargs:
        raise ValueError(f"{VARLEN} needs one packed row and cu_seq_lens_q/max_length_q")
    if sliding_window is not None or dropout:
        raise ValueError(f"{VARLEN} supports neither sliding windows nor attention dropout")
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

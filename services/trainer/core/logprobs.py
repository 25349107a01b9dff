"""Per-token logprobs and entropies at the sampling temperature, without [T × V] floats.

The engine samples from softmax(logits / T) and reports log of that
probability; the trainer must compute the same quantity or every importance
ratio is off by a temperature-dependent factor. From the raw logits z
(never post-processed scores), with lse = logsumexp(z / T):

    logp_t = z_t[y_t] / T - lse_t
    H_t    = sum_v p_v · d_v,   d_v = lse_t - z_t[v] / T ≥ 0,   p_v = exp(-d_v)

Entropy is written as a sum of non-negative terms: lse ≥ max(z / T) holds
exactly in floating point (logsumexp adds log of a sum ≥ 1 to the max), so
every d_v ≥ 0 and H ≥ 0. The textbook `lse - sum(p · z)` subtracts two
numbers of the size of the logits and goes negative on peaked rows of
large logits (~1% of LLM-like rows in float32).

Two implementations of the same quantities:

- `token_logprobs` / `token_entropy` take materialised logits [B, T, V].
  Simple, and the reference the tests hold the chunked one to; at a
  150k vocabulary and 16k tokens each float32 [T × V] tensor is ~10 GB.
- `chunked_token_stats` takes the hidden states and the LM head's weight
  and never holds more than `rows` rows of logits: the forward keeps only
  lse (and H) per token; the backward recomputes each chunk's logits and
  writes the gradient analytically,
      dlogp/dz = (onehot(y) - p) / T,   dH/dz = -p · (log p + H) / T,
  so peak memory is independent of the number of tokens, at the price of
  one more head matmul (the recomputation). The matmul runs in the compute
  dtype (bf16 under mixed precision, like the model's own head); softmax
  statistics and gradient accumulation run in float32 (float64 inputs stay
  float64, which is what lets a test compare gradients to 1e-6).
"""

from __future__ import annotations

from typing import Any

import torch


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    _check_temperature(temperature)
    z = logits.to(_stat_dtype(logits.dtype))
    return z / temperature if temperature != 1.0 else z


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(targets | ·) at `temperature`. logits [B, T, V], targets [B, T] -> [B, T]."""
    z = _scaled(logits, temperature)  # [B, T, V]
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(z, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, ≥ 0. logits [B, T, V] -> [B, T]."""
    z = _scaled(logits, temperature)  # [B, T, V]
    d = torch.logsumexp(z, dim=-1, keepdim=True) - z  # [B, T, V], ≥ 0
    return (torch.exp(-d) * d).sum(-1)


def chunk_rows(vocab: int, chunk_mib: float) -> int:
    """Rows per chunk so that one float32 chunk of logits takes about `chunk_mib` MiB."""
    return max(1, int(chunk_mib * 2**20) // (4 * vocab))


def chunked_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    bias: torch.Tensor | None = None,
    entropy: bool = False,
    rows: int = 1024,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of `targets` (and entropies) under logits = hidden @ weight.T + bias.

    hidden [N, H], weight [V, H], bias [V] or None, targets [N] int64 ->
    (logp [N], H [N] or None), in float32 (float64 for float64 inputs).
    `rows` logits rows are materialised at a time. `compute_dtype` is the
    matmul's dtype (default: the autocast dtype when autocast is on for
    hidden's device, else hidden's dtype). Differentiable in hidden,
    weight and bias; the entropy carries gradient only if it is used.
    """
    _check_temperature(temperature)
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = (
            torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        )
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    logp, ent = _ChunkedTokenStats.apply(
        hidden, weight, bias, targets, 1.0 / temperature, entropy, rows, compute_dtype
    )
    return logp, (ent if entropy else None)


def _chunk_logits(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, inv_t: float, dtype: torch.dtype
) -> torch.Tensor:
    """z / T for one chunk: [C, H] @ [H, V] in the compute dtype, then `dtype` [C, V]."""
    logits = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()
    z = logits.to(dtype)
    return z.mul_(inv_t) if inv_t != 1.0 else z


class _ChunkedTokenStats(torch.autograd.Function):
    """Forward: per-token lse, logp, H chunk by chunk. Backward: recompute, analytic grads."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V]
        targets: torch.Tensor,  # [N]
        inv_t: float,
        want_entropy: bool,
        rows: int,
        compute_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sd = _stat_dtype(compute_dtype)
        n = hidden.shape[0]
        # One cast of the head for the whole call (autocast would cache the same copy).
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        logp = torch.empty(n, dtype=sd, device=hidden.device)
        lse = torch.empty(n, dtype=sd, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=sd, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, rows):
                e = min(s + rows, n)
                z = _chunk_logits(hidden[s:e].to(compute_dtype), w, b, inv_t, sd)  # [C, V]
                lse_c = torch.logsumexp(z, dim=-1)  # [C], ≥ max(z) exactly
                lse[s:e] = lse_c
                logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse_c
                if want_entropy:
                    d = z.neg_().add_(lse_c[:, None])  # [C, V] lse - z ≥ 0, in place
                    ent[s:e] = (torch.exp(-d).mul_(d)).sum(-1)
        ctx.save_for_backward(hidden, w, b, targets, lse, ent)
        ctx.inv_t, ctx.rows, ctx.compute_dtype = inv_t, rows, compute_dtype
        ctx.weight_dtype, ctx.has_bias = weight.dtype, bias is not None
        ctx.set_materialize_grads(False)  # an unused entropy arrives as None: no work
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, w, b, targets, lse, ent = ctx.saved_tensors
        if ent.numel() == 0:
            g_ent = None
        sd, cd = lse.dtype, ctx.compute_dtype
        need = ctx.needs_input_grad
        grad_h = torch.zeros_like(hidden) if need[0] else None
        grad_w = torch.zeros(w.shape, dtype=sd, device=w.device) if need[1] else None
        grad_b = (
            torch.zeros(w.shape[0], dtype=sd, device=w.device) if ctx.has_bias and need[2] else None
        )
        if g_logp is not None or g_ent is not None:
            with torch.autocast(hidden.device.type, enabled=False):
                for s in range(0, hidden.shape[0], ctx.rows):
                    e = min(s + ctx.rows, hidden.shape[0])
                    h = hidden[s:e].to(cd)
                    gz = _chunk_grad(
                        _chunk_logits(h, w, b, ctx.inv_t, sd),
                        lse[s:e],
                        targets[s:e],
                        None if g_logp is None else g_logp[s:e].to(sd),
                        None if g_ent is None else (ent[s:e], g_ent[s:e].to(sd)),
                        ctx.inv_t,
                    ).to(cd)  # [C, V] dloss/dlogits
                    if grad_h is not None:
                        grad_h[s:e] = (gz @ w).to(hidden.dtype)
                    if grad_w is not None:
                        grad_w += (gz.t() @ h).to(sd)
                    if grad_b is not None:
                        grad_b += gz.sum(0, dtype=sd)
        wd = ctx.weight_dtype
        return grad_h, _cast(grad_w, wd), _cast(grad_b, wd), None, None, None, None, None


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _chunk_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    g_logp: torch.Tensor | None,
    entropy: tuple[torch.Tensor, torch.Tensor] | None,
    inv_t: float,
) -> torch.Tensor:
    """dloss/dlogits for one chunk, in place over z [C, V] (z = logits / T, consumed).

    With log p = z - lse:  g_z = g_logp · (onehot(y) - p) - g_H · p · (log p + H),
    then · 1/T for z = logits / T.
    """
    logp = z.sub_(lse[:, None])  # [C, V] log p
    p = torch.exp(logp)  # [C, V]
    if entropy is not None:
        ent, g_ent = entropy
        coef = logp.add_(ent[:, None]).mul_(g_ent[:, None])  # g_H · (log p + H)
        if g_logp is not None:
            coef.add_(g_logp[:, None])
        grad = p.mul_(coef).neg_()
    else:
        assert g_logp is not None
        grad = p.mul_(g_logp[:, None]).neg_()
    if g_logp is not None:
        grad.scatter_add_(1, targets[:, None], g_logp[:, None])
    return grad.mul_(inv_t) if inv_t != 1.0 else grad

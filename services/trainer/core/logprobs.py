"""Per-token logprobs and entropies at the sampling temperature, without [T × V] floats.

The engine samples from softmax(logits / T) and reports log of that
probability; the trainer must compute the same quantity or every importance
ratio is off by a temperature-dependent factor. From the raw logits z
(never post-processed scores), with lse = logsumexp(z / T):

    logp_t = z_t[y_t] / T - lse_t
    H_t    = sum_v p_v · d_v,   d_v = lse_t - z_t[v] / T ≥ 0,   p_v = exp(-d_v)

Entropy is written as a sum of non-negative terms: lse ≥ max(z / T) holds
exactly in floating point (logsumexp adds log of a sum ≥ 1 to the max), so
every d_v ≥ 0 and H ≥ 0 (the chunked version below uses the equivalent
H = log s + sum(e · (m - z)) / s with m = max z, e = exp(z - m), s = sum e).
The textbook `lse - sum(p · z)` subtracts two numbers of the size of the
logits and goes negative on peaked rows of large logits (~1% of LLM-like
rows in float32).

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


def _chunk_forward(
    z: torch.Tensor, targets: torch.Tensor, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse, logp, H) [C] of one chunk of z [C, V] (consumed).

    With m = max z, z' = z - m ≤ 0, e = exp(z'), s = sum e ≥ 1:
        lse = m + log s,  logp = z'[y] - log s,  H = log s + sum(e · -z') / s,
    H as a sum of two non-negative terms (nothing cancels, H ≥ 0 exactly).
    """
    m = z.amax(dim=-1, keepdim=True)  # [C, 1]
    zs = z.sub_(m)  # [C, V] ≤ 0
    e = torch.exp(zs)  # [C, V]
    total = e.sum(-1)  # [C] ≥ 1
    log_s = total.log()  # [C] ≥ 0
    logp = zs.gather(1, targets[:, None]).squeeze(1) - log_s
    ent = None
    if want_entropy:
        dot = torch.bmm(e[:, None, :], zs[:, :, None]).view(-1)  # sum(e · z') ≤ 0, no temp
        ent = log_s - dot / total
    return m.squeeze(1) + log_s, logp, ent


def _chunk_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    hits: tuple[torch.Tensor, torch.Tensor],
    g: torch.Tensor,
    entropy: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """dloss/dlogits [N, Vc] for one slice of the vocabulary, over z = logits / T (consumed).

    With log p = z - lse:  g_z = g_logp · (onehot(y) - p) - g_H · p · (log p + H);
    `g` and the entropy's g_H arrive already multiplied by dz/dlogits = 1/T.
    `hits` = (column of each row's target in this slice, clamped; g where
    the target falls in the slice, else 0): the onehot part, without a sync.
    """
    logp = z.sub_(lse[:, None])  # [N, Vc] log p
    if entropy is None:
        grad = logp.exp_().mul_(-g[:, None])  # -g · p
    else:
        ent, g_h = entropy
        p = torch.exp(logp)  # [N, Vc]
        coef = logp.mul_(-g_h[:, None]).sub_((g + g_h * ent)[:, None])  # -(g + g_H (log p + H))
        grad = p.mul_(coef)
    cols, vals = hits
    return grad.scatter_add_(1, cols[:, None], vals[:, None])


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b; in place (no temporary) when the dtypes agree."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


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
                lse[s:e], logp[s:e], ent_c = _chunk_forward(z, targets[s:e], want_entropy)
                if ent_c is not None:
                    ent[s:e] = ent_c
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
        """Chunked over the vocabulary: each slice's weight gradient is one matmul, written once.

        (Chunking the backward over tokens would add a [V × H] partial weight
        gradient per chunk into an accumulator: V·H·12 bytes of traffic per
        chunk, more than the chunk itself at a 150k vocabulary.) lse and H
        from the forward make any vocabulary slice's softmax computable alone.
        """
        hidden, w, b, targets, lse, ent = ctx.saved_tensors
        n, vocab = hidden.shape[0], w.shape[0]
        sd, cd, wd = lse.dtype, ctx.compute_dtype, ctx.weight_dtype
        need = ctx.needs_input_grad
        grad_h = torch.zeros(hidden.shape, dtype=sd, device=hidden.device) if need[0] else None
        grad_w = torch.zeros(w.shape, dtype=wd, device=w.device) if need[1] else None  # n = 0
        need_b = ctx.has_bias and need[2]
        grad_b = torch.zeros(vocab, dtype=wd, device=w.device) if need_b else None
        if ent.numel() == 0:
            g_ent = None
        if (g_logp is None and g_ent is None) or n == 0:
            return grad_h, grad_w, grad_b, None, None, None, None, None
        h = hidden.to(cd)  # [N, H]
        g = (torch.zeros_like(lse) if g_logp is None else g_logp.to(sd)) * ctx.inv_t  # [N]
        entropy = None if g_ent is None else (ent, g_ent.to(sd) * ctx.inv_t)
        cols = max(1, ctx.rows * vocab // n)  # the forward's element budget
        with torch.autocast(hidden.device.type, enabled=False):
            for v0 in range(0, vocab, cols):
                v1 = min(v0 + cols, vocab)
                inside = (targets >= v0) & (targets < v1)
                hits = ((targets - v0).clamp(0, v1 - v0 - 1), torch.where(inside, g, 0.0))
                z = _chunk_logits(h, w[v0:v1], None if b is None else b[v0:v1], ctx.inv_t, sd)
                gz = _chunk_grad(z, lse, hits, g, entropy).to(cd)  # [N, Vc] dloss/dlogits
                if grad_h is not None:
                    _accumulate_mm(grad_h, gz, w[v0:v1])
                if grad_w is not None:
                    grad_w[v0:v1] = gz.t() @ h
                if grad_b is not None:
                    grad_b[v0:v1] = gz.sum(0, dtype=sd)
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None

"""Per-token logprobs and entropies from logits, at the sampling temperature.

The engine samples from softmax(logits / T) and reports log of that
probability; the trainer must compute the same quantity or every importance
ratio is off by a temperature-dependent factor. Both are computed in float32
from the raw logits (never from post-processed scores):

    logp_t = z_t[y_t] / T - logsumexp(z_t / T)
    H_t    = logsumexp(z_t / T) - sum_v softmax(z_t / T)_v · z_t[v] / T
"""

from __future__ import annotations

import torch


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits.float() / temperature if temperature != 1.0 else logits.float()


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(targets | ·) at `temperature`. logits [B, T, V], targets [B, T] -> [B, T]."""
    z = _scaled(logits, temperature)  # [B, T, V]
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(z, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position. logits [B, T, V] -> [B, T]."""
    z = _scaled(logits, temperature)  # [B, T, V]
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # [B, T, 1]
    p = torch.exp(z - lse)
    return (lse.squeeze(-1) - (p * z).sum(-1)).float()

"""Per-row sampling and logprobs for a batch of sequences with different settings.

Every row of a decode batch may carry its own temperature, top-p, top-k and
seed, so the maths is vectorised over rows with per-row parameter tensors.

Which logprob is reported. The logprob of the sampled token is taken from
`log_softmax(raw_logits / T)` — the request's temperature applied to the raw
(fp32) logits, *before* top-p/top-k truncation. That is the distribution the
trainer recomputes from a plain forward pass (`log_softmax(logits / T)`
gathered at the response tokens), so the importance ratio pi_train/pi_rollout
compares like with like; truncation would make the rollout logprob depend on
sampler settings the trainer never sees. For greedy rows (T == 0) the
reported logprob is `log_softmax(raw_logits)` (T taken as 1).

Sampling uses the Gumbel-max trick: argmax(log p + G) with G = -log(-log U)
is an exact sample from p (Gumbel 1954; see e.g. Maddison et al. 2014, "A*
Sampling"). It lets a seeded row draw its own U from its own generator while
unseeded rows share one draw, with the rest of the batch vectorised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def truncation_mask(logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, V] of the tokens each row may sample.

    logp: [B, V] log-probabilities; top_p: [B] in (0, 1]; top_k: [B] int, 0 = all.
    Top-k keeps the k most likely tokens; top-p keeps the smallest set of most
    likely tokens whose mass reaches p (Holtzman et al. 2019), always keeping
    the most likely one. Both apply when both are set.
    """
    import torch

    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)  # [B, V]
    probs = sorted_logp.exp()
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, V] mass of strictly better tokens
    keep_sorted = mass_before < top_p[:, None]
    ranks = torch.arange(logp.shape[-1], device=logp.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, logp.shape[-1])
    keep_sorted &= ranks < k[:, None]
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def uniform_noise(
    batch: int, vocab: int, shared: torch.Generator, seeded: list[torch.Generator | None]
) -> torch.Tensor:
    """U(0,1) noise [B, V]: one shared draw, then each seeded row redrawn from its own generator.

    A seeded row's noise depends only on its own generator, so its samples do
    not change with the batch it happens to share.
    """
    import torch

    noise = torch.rand(batch, vocab, generator=shared)
    for row, gen in enumerate(seeded):
        if gen is not None:
            noise[row] = torch.rand(vocab, generator=gen)
    return noise


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [B] int64, logprobs [B] fp32).

    logits: [B, V] raw logits (any float dtype; computed in fp32);
    temperature: [B], 0 means greedy; top_p: [B]; top_k: [B] int (0 = off);
    noise: [B, V] uniform(0,1) from `uniform_noise`.
    """
    import torch

    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)  # [B, V] reported distribution
    needs_truncation = bool(((top_p < 1.0) | (top_k > 0)).any())
    scores = logp
    if needs_truncation:
        keep = truncation_mask(logp, top_p, top_k)
        scores = logp.masked_fill(~keep, float("-inf"))
    tiny = torch.finfo(noise.dtype).tiny
    gumbel = -torch.log(-torch.log(noise.clamp(min=tiny, max=1.0 - 1e-7)))  # [B, V]
    sampled = torch.argmax(scores + gumbel, dim=-1)  # [B]
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

"""The built-in losses, per token, as Tinker's loss docs define them: sums over tokens,
never means.

Each takes the trainer's logprobs of the target tokens, `logprobs` [N], the datum's
loss inputs (1-D arrays of length N, checked by core.check_batch) and the loss's
config (core.loss_config: loss_fn_config over its defaults), and returns the
per-token loss [N]; the request's loss is the sum over every token of every datum
(the SDK reports it as the metric `loss:sum`). The policy-gradient losses take the
sampler's logprobs `q` (input `logprobs`) and `advantages` A:

- importance_sampling  -(p/q) A
- ppo                  -min((p/q) A, clip(p/q, low, high) A)
- cispo                -sg(clip(p/q, low, high)) log p A
- dro                  -(log p A - beta/2 (log p - log q)^2)
- gspo                 -min(s_t A, clip(s_t, low, high) A), s_t = sg(s) p/sg(p), where s is
                       the geometric mean of p/q over the tokens `sequence_ratio_mask`
                       marks (GSPO-token: each token carries the sequence ratio's value
                       and its own logprob's gradient)

where p/q = exp(log p - log q) and sg stops the gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def elementwise(
    loss: str,
    logprobs: torch.Tensor,
    inputs: dict[str, np.ndarray],
    config: dict[str, float] | None = None,
) -> torch.Tensor:
    import torch

    config = config or {}

    def vec(name: str) -> torch.Tensor:
        return torch.tensor(inputs[name], dtype=torch.float32)  # a copy: the wire's are read-only

    if loss == "cross_entropy":
        # -log p(target) per token, weighted (weights 0 leave a prompt token out).
        weights = vec("weights") if "weights" in inputs else torch.ones_like(logprobs)
        return -(logprobs * weights)
    sampler, advantages = vec("logprobs"), vec("advantages")
    ratio = torch.exp(logprobs - sampler)
    if loss == "importance_sampling":
        # REINFORCE with an importance weight: its gradient is -ratio · A · ∇log p.
        return -(ratio * advantages)
    if loss == "ppo":
        # The pessimistic of the clipped and unclipped objectives: no gradient once
        # the ratio has left the band in the direction the advantage pushes it.
        clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.minimum(ratio * advantages, clipped * advantages)
    if loss == "cispo":
        # The clipped ratio is a constant weight on ∇log p: every token keeps a gradient.
        clipped = ratio.detach().clamp(config["clip_low_threshold"], config["clip_high_threshold"])
        return -(clipped * logprobs * advantages)
    if loss == "dro":
        return -(logprobs * advantages - 0.5 * config["beta"] * (logprobs - sampler) ** 2)
    if loss == "gspo":
        # The datum is one sequence; its mask marks the tokens the ratio's mean is over
        # (core.check_batch: at least one). Every token carries the mean's value, with
        # its own logprob's gradient: exp(mean + lp - sg(lp)).
        marked = vec("sequence_ratio_mask") != 0
        log_ratio = (logprobs.detach() - sampler)[marked].mean()
        seq = torch.exp(log_ratio + logprobs - logprobs.detach())
        clipped = seq.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.minimum(seq * advantages, clipped * advantages)
    raise AssertionError(f"core.check_batch let through loss {loss!r}")

"""The built-in losses, per token, as Tinker defines them: sums over tokens, never means.

Each takes the trainer's logprobs of the target tokens, `logprobs` [N], and the
datum's loss inputs (1-D arrays of length N, checked by core.check_batch) and
returns the per-token loss [N]; the request's loss is the sum over every token
of every datum (the SDK reports it as the metric `loss:sum`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def elementwise(loss: str, logprobs: torch.Tensor, inputs: dict[str, np.ndarray]) -> torch.Tensor:
    import torch

    def vec(name: str) -> torch.Tensor:
        return torch.tensor(inputs[name], dtype=torch.float32)  # a copy: the wire's are read-only

    if loss == "cross_entropy":
        # -log p(target) per token, weighted (weights 0 leave a prompt token out).
        weights = vec("weights") if "weights" in inputs else torch.ones_like(logprobs)
        return -(logprobs * weights)
    if loss == "importance_sampling":
        # REINFORCE with an importance weight p_train / p_sampler, the sampler's
        # logprobs given per token: -(ratio · advantage); its gradient is
        # -ratio · advantage · ∇log p_train.
        ratio = torch.exp(logprobs - vec("logprobs"))
        return -(ratio * vec("advantages"))
    raise AssertionError(f"core.check_batch let through loss {loss!r}")

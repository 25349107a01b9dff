"""The built-in losses, per token, against their definitions (and their gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.tinker.losses import elementwise


def test_cross_entropy_is_the_weighted_negative_logprob_summed() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    w = np.array([0.0, 1.0, 2.0], np.float32)
    per_token = elementwise("cross_entropy", lp, {"target_tokens": np.zeros(3), "weights": w})
    assert per_token.tolist() == [0.0, 2.0, 1.0]
    per_token.sum().backward()
    assert lp.grad is not None and lp.grad.tolist() == [-0.0, -1.0, -2.0]
    unweighted = elementwise("cross_entropy", lp.detach(), {"target_tokens": np.zeros(3)})
    assert unweighted.tolist() == [1.0, 2.0, 0.5]


def test_importance_sampling_weighs_the_advantage_by_the_ratio() -> None:
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    sampler = np.array([-1.0, -1.0], np.float32)
    adv = np.array([2.0, -1.0], np.float32)
    inputs = {"target_tokens": np.zeros(2), "logprobs": sampler, "advantages": adv}
    per_token = elementwise("importance_sampling", lp, inputs)
    ratio = np.exp([0.0, -1.0])
    assert per_token.tolist() == pytest.approx((-ratio * adv).tolist())
    per_token.sum().backward()  # d/dlp of -(exp(lp - q) · A) = -ratio · A
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx((-ratio * adv).tolist())

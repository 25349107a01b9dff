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


def _rl(lp: list[float], sampler: list[float], adv: list[float]) -> tuple[torch.Tensor, dict]:
    inputs = {
        "target_tokens": np.zeros(len(lp)),
        "logprobs": np.array(sampler, np.float32),
        "advantages": np.array(adv, np.float32),
    }
    return torch.tensor(lp, requires_grad=True), inputs


def test_ppo_clips_the_ratio_pessimistically_by_hand() -> None:
    # ratios e^0.5 = 1.6487 (A 1: clipped to 1.2), e^-0.5 = 0.6065 (A -1: clipped to 0.8),
    # e^0.1 = 1.1052 (inside the band), e^0.5 with A -1 (the unclipped one is lower).
    lp, inputs = _rl([-1.0, -2.0, -0.5, -1.0], [-1.5, -1.5, -0.6, -1.5], [1.0, -1.0, 2.0, -1.0])
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    per_token = elementwise("ppo", lp, inputs, config)
    assert per_token.tolist() == pytest.approx([-1.2, 0.8, -2.2103418, 1.6487213], abs=1e-6)
    per_token.sum().backward()  # clipped tokens give no gradient; the others -ratio · A
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -2.2103418, 1.6487213], abs=1e-6)
    # A wider band leaves the first token unclipped.
    wide = elementwise("ppo", lp.detach(), inputs, {**config, "clip_high_threshold": 2.0})
    assert wide[0].item() == pytest.approx(-1.6487213)


def test_cispo_weighs_log_p_by_the_clipped_ratio_without_its_gradient_by_hand() -> None:
    lp, inputs = _rl([-1.0, -0.5], [-3.0, -0.5], [1.0, 2.0])  # ratios e^2 = 7.389 and 1
    per_token = elementwise("cispo", lp, inputs, {"clip_low_threshold": 0.0,
                                                   "clip_high_threshold": 4.0})  # fmt: skip
    assert per_token.tolist() == pytest.approx([4.0, 1.0])  # -(4 · -1 · 1), -(1 · -0.5 · 2)
    per_token.sum().backward()
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-4.0, -2.0])
    narrow = elementwise("cispo", lp.detach(), inputs, {"clip_low_threshold": 0.5,
                                                         "clip_high_threshold": 2.0})  # fmt: skip
    assert narrow.tolist() == pytest.approx([2.0, 1.0])


def test_dro_is_the_advantage_term_minus_a_quadratic_penalty_by_hand() -> None:
    lp, inputs = _rl([-1.0, -2.0], [-1.5, -1.0], [1.0, -0.5])
    per_token = elementwise("dro", lp, inputs, {"beta": 0.1})
    # -(lp·A - 0.05·(lp - q)²): -(-1 - 0.05·0.25), -(1 - 0.05·1)
    assert per_token.tolist() == pytest.approx([1.0125, -0.95])
    per_token.sum().backward()  # -(A - beta·(lp - q))
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-0.95, 0.4])


def test_gspo_gives_each_token_the_sequence_ratio_and_its_own_gradient_by_hand() -> None:
    # Token log-ratios 0.3, -0.1 and 2.0; the mask leaves the third out of the sequence
    # ratio: s = exp(mean(0.3, -0.1)) = e^0.1 = 1.1052 for every token, the third too.
    lp, inputs = _rl([-1.0, -2.0, -0.5], [-1.3, -1.9, -2.5], [1.0, -1.0, 2.0])
    inputs["sequence_ratio_mask"] = np.array([1.0, 1.0, 0.0], np.float32)
    s = float(np.exp(0.1))
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    per_token = elementwise("gspo", lp, inputs, wide)
    assert per_token.tolist() == pytest.approx([-s, s, -2 * s], abs=1e-6)
    per_token.sum().backward()  # the value s, the gradient s · ∇lp_t: -s · A_t
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-s, s, -2 * s], abs=1e-6)
    # A band s leaves from above: the tokens with A > 0 are clipped (no gradient), the
    # token with A < 0 keeps the unclipped, lower term.
    lp.grad = None
    narrow = elementwise("gspo", lp, inputs, {"clip_low_threshold": 0.9997,
                                               "clip_high_threshold": 1.0004})  # fmt: skip
    assert narrow.tolist() == pytest.approx([-1.0004, s, -2 * 1.0004], abs=1e-6)
    narrow.sum().backward()
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([0.0, s, 0.0], abs=1e-6)
    # The masked-out token's own ratio (e^2) changes nothing: the mask decides s.
    inputs["sequence_ratio_mask"] = np.ones(3, np.float32)
    all_three = elementwise("gspo", lp.detach(), inputs, {**wide, "clip_high_threshold": 3.0})
    assert all_three[0].item() == pytest.approx(-float(np.exp(2.2 / 3)), abs=1e-6)

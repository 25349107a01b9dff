"""Exploration kept up: Clip-Cov, KL-Cov and the adaptive entropy coefficient against
closed forms worked by hand on a four-token example (core/loss.py's docstring)."""

import math

import pytest
import torch
from pydantic import ValidationError

from services.trainer.core.loss import (
    clip_cov_drop,
    covariance_count,
    kl_cov_select,
    next_entropy_coef,
    policy_loss,
    sample_weights,
    token_covariance,
    token_weights,
)
from services.trainer.settings import LossConfig

# Two samples; loss tokens (A, logp): (1, -1), (1, -2), (1, -3) and (-1, -4).
LOGP = [[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
# mean A = 0.5, mean logp = -2.5 over the four loss tokens:
# cov = (0.5)(1.5), (0.5)(0.5), (0.5)(-0.5), (-1.5)(-1.5); 0 off the mask
COV = torch.tensor([[0.75, 0.25, -0.25], [2.25, 0.0, 0.0]])


def _batch(delta: list[list[float]]):
    """logp (requires grad), old = logp - delta (so log r = delta), token-mean weights."""
    logp = torch.tensor(LOGP, requires_grad=True)
    old = logp.detach() - torch.tensor(delta)
    w = token_weights(MASK, sample_weights(MASK.sum(-1), "token-mean"))  # 1/4 per token
    return logp, old, w


def test_token_covariance_is_the_centred_product_over_loss_tokens():
    cov = token_covariance(torch.tensor(LOGP, requires_grad=True), ADV, MASK)
    torch.testing.assert_close(cov, COV)
    assert not cov.requires_grad


def test_covariance_count_is_at_least_one():
    assert covariance_count(2e-4, 100) == 1
    assert covariance_count(0.5, 4) == 2
    assert covariance_count(0.3, 10) == 3


def test_kl_cov_selects_the_largest_covariances():
    got = kl_cov_select(COV, MASK, LossConfig(kl_cov_fraction=0.5))  # k = 2 of 4
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    got = kl_cov_select(COV, MASK, LossConfig(kl_cov_fraction=1e-3))  # at least one
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert float(kl_cov_select(COV, torch.zeros_like(MASK), LossConfig()).sum()) == 0


def test_kl_cov_loss_value_and_gradient():
    delta = [[0.1, -0.2, 0.0], [-0.1, 0.0, 0.0]]  # log r per token
    logp, old, w = _batch(delta)
    cfg = LossConfig(covariance="kl_cov", kl_cov_fraction=0.5, kl_cov_coef=0.5, eps_high=10.0)
    out = policy_loss(logp, old, ADV, MASK, w, cfg)
    # pg = -A r on every token (no clip bites: r in [0.8, 1.2] where A < 0, eps_high 10);
    # + 0.5 |log r| on the two largest covariances, (0, 0) and (1, 0): 0.05 each
    e = math.exp
    want = (-e(0.1) - e(-0.2) - 1 + e(-0.1) + 0.05 + 0.05) / 4
    assert float(out.loss.detach()) == pytest.approx(want, abs=1e-6)
    assert float(out.sums["kl_cov_frac"]) == 2
    out.loss.backward()
    # d(-A r)/dlogp = -A r; d(0.5 |log r|)/dlogp = 0.5 sign(log r): +0.5 at (0,0), -0.5 at (1,0)
    want_grad = torch.tensor([[-e(0.1) + 0.5, -e(-0.2), -1.0], [e(-0.1) - 0.5, 0.0, 0.0]]) / 4
    torch.testing.assert_close(logp.grad, want_grad)


def test_clip_cov_drops_a_candidate_whose_clip_is_not_already_active():
    # (1, 0): A = -1 and r = e^-0.5 < 0.8, PPO's clip is active there: no candidate;
    # band (0.5, 3): of the rest only (0, 0) (cov 0.75) qualifies.
    delta = [[0.1, -0.2, 0.0], [-0.5, 0.0, 0.0]]
    logp, old, w = _batch(delta)
    cfg = LossConfig(covariance="clip_cov", clip_cov_band=(0.5, 3.0), clip_cov_fraction=0.5)
    out = policy_loss(logp, old, ADV, MASK, w, cfg, generator=torch.Generator().manual_seed(0))
    e = math.exp
    # (0, 0) dropped; (0, 1): -r; (0, 2): -1; (1, 0): clipped at -A · 0.8 = 0.8
    assert float(out.loss.detach()) == pytest.approx((-e(-0.2) - 1 + 0.8) / 4, abs=1e-6)
    assert float(out.sums["clip_cov_frac"]) == 1
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -e(-0.2), -1.0], [0.0] * 3]) / 4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_clip_cov_draws_n_of_the_candidates_at_random():
    cfg = LossConfig(covariance="clip_cov", clip_cov_band=(0.5, 3.0), clip_cov_fraction=0.25)
    none_clipped = torch.zeros_like(MASK, dtype=torch.bool)
    seen = set()
    for seed in range(20):
        drop = clip_cov_drop(COV, MASK, none_clipped, cfg, _gen(seed))
        assert float(drop.sum()) == 1  # n = max(1, floor(0.25 · 4)) of 2 candidates
        seen.add(tuple(drop.nonzero()[0].tolist()))
    assert seen == {(0, 0), (1, 0)}  # cov 0.75 and 2.25: both drawn, nothing else
    again = clip_cov_drop(COV, MASK, none_clipped, cfg, _gen(3))
    assert torch.equal(again, clip_cov_drop(COV, MASK, none_clipped, cfg, _gen(3)))
    many = cfg.model_copy(update={"clip_cov_fraction": 1.0})  # n = 4 > 2 candidates: both
    torch.testing.assert_close(
        clip_cov_drop(COV, MASK, none_clipped, many, _gen(0)),
        torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]),
    )


def test_clip_cov_draws_from_its_generator_alone():
    """Only the generator handed in decides the draw, and only its state moves: torch's
    default generator, reseeded or drawn from meanwhile (another thread's evaluation), is
    neither read nor changed; without a generator Clip-Cov refuses rather than fall back."""
    cfg = LossConfig(covariance="clip_cov", clip_cov_band=(0.5, 3.0), clip_cov_fraction=0.25)
    none_clipped = torch.zeros_like(MASK, dtype=torch.bool)
    mine = _gen(7)
    want = [clip_cov_drop(COV, MASK, none_clipped, cfg, mine) for _ in range(12)]
    assert len({tuple(d.nonzero()[0].tolist()) for d in want}) == 2  # the stream varies
    mine = _gen(7)
    for i, w in enumerate(want):
        torch.manual_seed(i)  # what evaluate.py used to do on its thread, at any moment
        assert torch.equal(clip_cov_drop(COV, MASK, none_clipped, cfg, mine), w), i
        torch.manual_seed(i)
        torch.rand(3)
    torch.manual_seed(0)
    default_before = torch.get_rng_state()
    clip_cov_drop(COV, MASK, none_clipped, cfg, _gen(1))
    assert torch.equal(torch.get_rng_state(), default_before)  # the default one untouched
    logp, old, w = _batch([[0.1, -0.2, 0.0], [-0.1, 0.0, 0.0]])
    with pytest.raises(ValueError, match="generator"):
        policy_loss(logp, old, ADV, MASK, w, cfg)


def test_covariance_off_changes_nothing():
    delta = [[0.1, -0.2, 0.0], [-0.1, 0.0, 0.0]]
    logp, old, w = _batch(delta)
    plain = policy_loss(logp, old, ADV, MASK, w, LossConfig())
    assert "clip_cov_frac" not in plain.sums and "kl_cov_frac" not in plain.sums
    e = math.exp
    want = (-e(0.1) - e(-0.2) - 1 + e(-0.1)) / 4
    assert float(plain.loss.detach()) == pytest.approx(want, abs=1e-6)


def test_next_entropy_coef_closed_form():
    cfg = LossConfig(
        entropy_control="adaptive", entropy_target=0.2, entropy_coef_lr=0.02, entropy_coef_max=0.05
    )
    # below the target: up by lr · gap = 0.02 · 0.15 = 0.003
    assert next_entropy_coef(0.01, 0.05, cfg) == pytest.approx(0.013)
    # above it: down, and never below 0
    assert next_entropy_coef(0.01, 0.7, cfg) == pytest.approx(0.0)
    assert next_entropy_coef(0.02, 0.45, cfg) == pytest.approx(0.015)
    # never above the ceiling
    assert next_entropy_coef(0.049, 0.0, cfg) == pytest.approx(0.05)
    # no reading (entropy not measured, or NaN): nothing moves
    assert next_entropy_coef(0.01, None, cfg) == 0.01
    assert next_entropy_coef(0.01, float("nan"), cfg) == 0.01
    # fixed: the coefficient is the configured one whatever the entropy
    assert next_entropy_coef(0.01, 0.0, LossConfig(entropy_coef=0.01)) == 0.01


def test_the_controller_over_steps_is_the_clipped_running_sum():
    cfg = LossConfig(
        entropy_control="adaptive", entropy_target=0.3, entropy_coef_lr=0.1, entropy_coef_max=0.04
    )
    readings = [0.1, 0.1, 0.2, 0.6, 0.6, 0.25]
    c, got = 0.0, []
    for h in readings:
        c = next_entropy_coef(c, h, cfg)
        got.append(c)
    # 0 + 0.02 = 0.02; 0.04; min(0.05, 0.04) = 0.04; 0.04 - 0.03 = 0.01; max(-0.02, 0) = 0; 0.005
    assert got == pytest.approx([0.02, 0.04, 0.04, 0.01, 0.0, 0.005])


def test_the_step_s_coefficient_overrides_the_configured_one():
    logp, old, w = _batch([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    cfg = LossConfig(entropy_coef=0.1)
    base = policy_loss(logp, old, ADV, MASK, w, LossConfig())
    fixed = policy_loss(logp, old, ADV, MASK, w, cfg, entropy=ent)
    moved = policy_loss(logp, old, ADV, MASK, w, cfg, entropy=ent, entropy_coef=0.3)
    # token-mean entropy (1 + 2 + 3 + 4) / 4 = 2.5
    b = float(base.loss.detach())
    assert float(fixed.loss.detach()) == pytest.approx(b - 0.1 * 2.5, abs=1e-6)
    assert float(moved.loss.detach()) == pytest.approx(b - 0.3 * 2.5, abs=1e-6)
    off = policy_loss(logp, old, ADV, MASK, w, cfg, entropy=ent, entropy_coef=0.0)
    assert float(off.loss.detach()) == pytest.approx(b, abs=1e-6)
    assert "entropy_bonus" not in off.parts and float(off.sums["entropy"]) == 10.0


def test_settings_bound_the_controls():
    with pytest.raises(ValidationError, match="low < high"):
        LossConfig(clip_cov_band=(5.0, 1.0))
    with pytest.raises(ValidationError):
        LossConfig(covariance="cov")
    with pytest.raises(ValidationError):
        LossConfig(kl_cov_fraction=0.0)
    with pytest.raises(ValidationError):
        LossConfig(entropy_control="auto")
    with pytest.raises(ValidationError):
        LossConfig(entropy_coef_max=0.0)
    with pytest.raises(ValidationError, match="above entropy_coef_max"):
        LossConfig(entropy_control="adaptive", entropy_coef=0.1, entropy_coef_max=0.05)
    assert LossConfig(entropy_coef=0.1).entropy_coef == 0.1  # a fixed weight has no ceiling

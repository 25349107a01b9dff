"""Policy loss, aggregation, KL and logprob formulas against hand-computed values."""

import math

import pytest
import torch

from services.trainer.core.logprobs import token_entropy, token_logprobs
from services.trainer.core.loss import (
    aggregate,
    clipped_surrogate,
    importance_ratio,
    kl_penalty,
    policy_loss,
    sample_weights,
    token_weights,
)
from services.trainer.settings import LossConfig


def lp(x):
    return torch.log(torch.tensor(x, dtype=torch.float32))


def test_clip_higher_is_asymmetric():
    ratio = torch.tensor([0.5, 0.5, 1.1, 1.25, 1.5, 1.5])
    adv = torch.tensor([-1.0, 1.0, 1.0, 1.0, 1.0, -1.0])
    loss = clipped_surrogate(ratio, adv, eps_low=0.2, eps_high=0.28)
    # A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped low); A>0, r=0.5: max(-0.5, -0.8) = -0.5;
    # A>0, r=1.1: -1.1; r=1.25 is inside 1.28: -1.25; r=1.5 clipped at -1.28;
    # A<0, r=1.5: max(1.5, 1.28) = 1.5 (no clip for A<0 above).
    torch.testing.assert_close(loss, torch.tensor([0.8, -0.5, -1.1, -1.25, -1.28, 1.5]))
    sym = clipped_surrogate(ratio, adv, eps_low=0.2, eps_high=0.2)
    assert float(sym[3]) == pytest.approx(-1.2)  # symmetric clip caps 1.25 at 1.2


def test_dual_clip_caps_negative_advantages_only():
    ratio = torch.tensor([5.0, 2.0, 5.0])
    adv = torch.tensor([-2.0, -2.0, 2.0])
    loss = clipped_surrogate(ratio, adv, 0.2, 0.2, dual_clip_c=3.0)
    # A=-2, r=5: max(10, 2.4)=10 capped at c·|A| = 6; r=2 < c: 4; A>0 untouched: -2.4.
    torch.testing.assert_close(loss, torch.tensor([6.0, 4.0, -2.4]))


def test_gspo_sequence_ratio_value_and_gradient():
    logp = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.4), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    r = importance_ratio(logp, old, mask, sequence_level=True)
    # geometric mean of 2 and 0.5 is 1 on both loss tokens.
    torch.testing.assert_close(r[0, :2], torch.tensor([1.0, 1.0]))
    (r[0, :2].sum()).backward()
    # d r_t / d logp_t = s_i = 1 (stop-gradient form of GSPO §4).
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, 1.0, 0.0]]))


def test_kl_estimators_hand_values():
    logp, ref = lp([0.5]), lp([0.25])  # log rho = log 0.5
    lr = math.log(0.5)
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(-lr)
    assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.5 * lr * lr)
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 - 1 - lr)
    assert float(kl_penalty(logp, logp, "k3")) == 0.0


def test_aggregation_modes_hand_values():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(values, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    # sums 6 and 4, normaliser 4 given, mean over 2 sequences.
    got = aggregate(values, mask, "seq-mean-token-sum-norm", norm_tokens=4)
    assert float(got) == pytest.approx((6 / 4 + 4 / 4) / 2)
    # default normaliser: longest loss-token count (3).
    got = aggregate(values, mask, "seq-mean-token-sum-norm")
    assert float(got) == pytest.approx((6 / 3 + 4 / 3) / 2)


def test_sample_weights_ignore_empty_samples():
    w = sample_weights(torch.tensor([2.0, 0.0, 4.0]), "seq-mean-token-mean")
    torch.testing.assert_close(w, torch.tensor([1 / 4, 0.0, 1 / 8], dtype=torch.float64))


def test_logprobs_and_entropy_at_temperature():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    t = 2.0
    z = torch.tensor([1.0, 0.0, 0.0])
    p = torch.exp(z) / torch.exp(z).sum()
    got = token_logprobs(logits, torch.tensor([[0]]), temperature=t)
    assert float(got) == pytest.approx(float(torch.log(p[0])))
    assert float(token_entropy(logits, t)) == pytest.approx(float(-(p * p.log()).sum()))
    with pytest.raises(ValueError):
        token_logprobs(logits, torch.tensor([[0]]), temperature=0.0)


def _inputs():
    logp = lp([[0.5, 0.9, 0.3]]).requires_grad_(True)
    old = lp([[0.25, 0.9, 0.6]])  # ratios 2, 1, 0.5
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w = token_weights(mask, sample_weights(mask.sum(-1), "token-mean"))
    return logp, old, adv, mask, w


def test_policy_loss_value_metrics_and_grad():
    logp, old, adv, mask, w = _inputs()
    out = policy_loss(logp, old, adv, mask, w, LossConfig(eps_low=0.2, eps_high=0.28))
    # per-token: -min(r, clip) for A=1 -> -1.28, -1, -0.5 ; token-mean.
    assert float(out.loss.detach()) == pytest.approx(-(1.28 + 1 + 0.5) / 3, abs=1e-6)
    assert float(out.sums["clip_frac_high"]) == 1 and float(out.sums["clip_frac_low"]) == 0
    assert float(out.sums["ratio"]) == pytest.approx(3.5, abs=1e-5)
    assert float(out.maxes["ratio_max"]) == pytest.approx(2.0)
    # approx_kl (k3 of old vs new): (1/r - 1) - log(1/r) summed.
    want = sum((1 / r - 1) + math.log(r) for r in (2.0, 1.0, 0.5))
    assert float(out.sums["approx_kl"]) == pytest.approx(want, abs=1e-5)
    out.loss.backward()
    # clipped token has no gradient; others: d(-r)/dlogp = -r, times weight 1/3.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1 / 3, -0.5 / 3]]))


def test_tis_weights_only_with_recompute():
    logp, old, adv, mask, w = _inputs()
    rollout = lp([[0.125, 0.9, 0.6]])  # pi_old / mu = 2, 1, 1
    cfg = LossConfig(old_logprobs="recompute", tis_cap=1.5, eps_high=10.0)
    out = policy_loss(logp, old, adv, mask, w, cfg, rollout_logprobs=rollout)
    # pg = -r = -2, -1, -0.5 ; TIS min(2, 1.5)=1.5 on the first.
    assert float(out.loss) == pytest.approx(-(2 * 1.5 + 1 + 0.5) / 3, abs=1e-6)
    assert float(out.sums["tis_clip_frac"]) == 1
    plain = policy_loss(logp, old, adv, mask, w, cfg.model_copy(update={"old_logprobs": "rollout"}))
    assert float(plain.loss) == pytest.approx(-(2 + 1 + 0.5) / 3, abs=1e-6)


def test_kl_and_entropy_terms():
    logp, old, adv, mask, w = _inputs()
    ref = logp.detach()
    ent = torch.tensor([[1.0, 2.0, 3.0]])
    base = policy_loss(logp, old, adv, mask, w, LossConfig(eps_high=10.0))
    cfg = LossConfig(eps_high=10.0, kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    ref = lp([[0.25, 0.9, 0.3]])  # k1 = logp - ref = log 2, 0, 0
    out = policy_loss(logp, old, adv, mask, w, cfg, ref_logprobs=ref, entropy=ent)
    want = float(base.loss) + 0.5 * math.log(2) / 3 - 0.1 * 2.0
    assert float(out.loss) == pytest.approx(want, abs=1e-6)
    assert float(out.sums["entropy"]) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, w, cfg)


def test_masked_tokens_do_not_count():
    logp, old, adv, _, _ = _inputs()
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    w = token_weights(mask, sample_weights(mask.sum(-1), "token-mean"))
    out = policy_loss(logp, old, adv, mask, w, LossConfig())
    assert float(out.loss) == pytest.approx(-(1 + 0.5) / 2, abs=1e-6)
    assert float(out.maxes["ratio_max"]) == pytest.approx(1.0)
    assert float(out.tokens) == 2

"""Train–inference mismatch metrics and MIS masks against closed forms (core/loss.py)."""

import math

import pytest
import torch
from pydantic import ValidationError

from proto.examples import sample
from proto.weight_version import VersionSpan
from services.trainer.core.batching import MetricAccumulator, TensorBatch, split_groups
from services.trainer.core.loss import policy_loss, sample_weights, token_weights
from services.trainer.settings import LossConfig
from services.trainer.wire import token_versions


def lp(x):
    return torch.log(torch.tensor(x, dtype=torch.float64))


def finalize(*outs):
    acc = MetricAccumulator()
    for o in outs:
        acc.add(o)
    return acc.finalize(*acc.as_tensors())


def _two_rows():
    """Two sequences of 3 tokens, A = 1; with old_logprobs = "rollout" the PPO ratio is rho."""
    trainer = lp([[0.5, 0.4, 0.2], [0.5, 0.5, 0.5]])
    # engine probabilities: rho = pi / mu = 2, 1, 0.25 on row 0; 1.25 on every token of row 1
    engine = lp([[0.25, 0.4, 0.8], [0.4, 0.4, 0.4]])
    adv = torch.ones(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    w = token_weights(mask, sample_weights(mask.sum(-1), "token-mean")).double()
    return trainer, engine, adv, mask, w


def test_mismatch_metrics_are_over_same_version_tokens_only():
    trainer, engine, adv, mask, w = _two_rows()
    same = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    out = policy_loss(trainer, engine, adv, mask, w, LossConfig(), rollout_logprobs=engine,
                      same_version=same)  # fmt: skip
    m = finalize(out)
    # same-version tokens: log rho = log 2, log 1
    assert m["mismatch_tokens"] == pytest.approx(2 / 6)
    assert m["mismatch_abs_mean"] == pytest.approx(math.log(2) / 2)
    assert m["mismatch_abs_max"] == pytest.approx(math.log(2))
    assert m["mismatch_k3"] == pytest.approx((2 - 1 - math.log(2)) / 2)
    # behaviour_k3: every loss token, rho = 2, 1, 0.25, 1.25 x3
    k3 = [r - 1 - math.log(r) for r in (2, 1, 0.25, 1.25, 1.25, 1.25)]
    assert m["behaviour_k3"] == pytest.approx(sum(k3) / 6)


def test_mismatch_is_absent_when_no_token_shares_the_version():
    trainer, engine, adv, mask, w = _two_rows()
    none = torch.zeros(2, 3, dtype=torch.float64)
    cfg = LossConfig()
    m = finalize(policy_loss(trainer, engine, adv, mask, w, cfg, rollout_logprobs=engine,
                             same_version=none))  # fmt: skip
    assert "mismatch_abs_mean" not in m and "mismatch_abs_max" not in m
    assert "mismatch_k3" not in m and m["mismatch_tokens"] == 0
    unknown = finalize(policy_loss(trainer, engine, adv, mask, w, cfg, rollout_logprobs=engine))
    assert "mismatch_tokens" not in unknown and "behaviour_k3" in unknown


def test_mis_token_band_drops_the_pg_term_of_tokens_outside_it():
    trainer, engine, adv, mask, w = _two_rows()
    logp = trainer.clone().requires_grad_(True)
    cfg = LossConfig(mis_token_band=(0.5, 1.5))
    out = policy_loss(logp, engine, adv, mask, w, cfg, rollout_logprobs=engine)
    # old_logprobs = "rollout": the PPO ratio is pi / mu = rho; the band keeps 1, 1.25 x3
    # (2 and 0.25 leave it). pg = -A·clip(rho) on kept tokens: -1, -1.2 x3 (eps_high 0.2).
    assert float(out.loss.detach()) == pytest.approx(-(1 + 3 * 1.2) / 6)
    assert float(out.sums["mis_token_masked_frac"]) == 2
    out.loss.backward()
    # gradient only where kept and unclipped: d(-rho)/dlogp = -rho = -1 on token (0, 1)
    want = torch.tensor([[0.0, -1 / 6, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want)


def test_mis_seq_band_masks_whole_sequences_by_their_geometric_mean():
    trainer, engine, adv, mask, w = _two_rows()
    # geometric means: row 0 (2 · 1 · 0.25)^(1/3) = 0.794; row 1 1.25
    cfg = LossConfig(mis_seq_band=(0.9, 2.0), eps_high=10.0, eps_low=0.99)
    out = policy_loss(trainer, engine, adv, mask, w, cfg, rollout_logprobs=engine)
    assert float(out.loss) == pytest.approx(-(3 * 1.25) / 6)
    assert float(out.sums["mis_seq_masked_frac"]) == 3
    tight = cfg.model_copy(update={"mis_seq_band": (0.5, 1.0)})  # now row 1 (1.25) leaves
    out = policy_loss(trainer, engine, adv, mask, w, tight, rollout_logprobs=engine)
    assert float(out.loss) == pytest.approx(-(2 + 1 + 0.25) / 6)


def test_mis_seq_band_in_packed_rows_equals_one_row_per_sequence():
    trainer, engine, adv, mask, w = _two_rows()
    cfg = LossConfig(mis_seq_band=(0.9, 2.0), eps_high=10.0, eps_low=0.99)
    rows = policy_loss(trainer, engine, adv, mask, w, cfg, rollout_logprobs=engine)
    flat = {k: v.reshape(1, 6) for k, v in (("t", trainer), ("e", engine), ("a", adv),
                                             ("m", mask), ("w", w))}  # fmt: skip
    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
    packed = policy_loss(flat["t"], flat["e"], flat["a"], flat["m"], flat["w"], cfg,
                         rollout_logprobs=flat["e"], segment_ids=seg)  # fmt: skip
    assert float(packed.loss) == pytest.approx(float(rows.loss))
    assert float(packed.sums["mis_seq_masked_frac"]) == 3


def test_mis_uses_the_recomputed_old_logprobs_with_recompute():
    trainer, engine, adv, mask, w = _two_rows()
    current = trainer + 0.05  # the update moved pi: only pi_old / mu decides the mask
    cfg = LossConfig(old_logprobs="recompute", tis_cap=None, mis_token_band=(0.5, 1.5),
                     eps_high=10.0, eps_low=0.99)  # fmt: skip
    out = policy_loss(current, trainer, adv, mask, w, cfg, rollout_logprobs=engine)
    r = math.exp(0.05)  # the PPO ratio pi / pi_old on every token
    assert float(out.loss) == pytest.approx(-(4 * r) / 6)


def test_bands_are_validated():
    LossConfig(mis_token_band=(0.5, 2.0), mis_seq_band=(1.0, 1.0))
    for bad in ((2.0, 3.0), (0.5, 0.9), (-1.0, 2.0)):
        with pytest.raises(ValidationError):
            LossConfig(mis_token_band=bad)


def test_token_versions_from_spans_or_the_one_version():
    s = sample(0)  # 3 response tokens
    spans = (VersionSpan(version=4, start=0, end=2), VersionSpan(version=5, start=2, end=3))
    with_spans = s.model_copy(update={"weight_version": 4, "weight_version_last": 5,
                                      "weight_version_spans": spans})  # fmt: skip
    assert token_versions(with_spans).tolist() == [4, 4, 5]
    one = s.model_copy(update={"weight_version": 7, "weight_version_last": 7})
    assert token_versions(one).tolist() == [7, 7, 7]
    unknown = s.model_copy(update={"weight_version": 6, "weight_version_last": 7})
    assert token_versions(unknown).tolist() == [-1, -1, -1]


def test_mini_batches_keep_each_samples_token_versions():
    n = 4
    batch = TensorBatch(
        prompt_ids=[torch.tensor([1, 2])] * n,
        response_ids=[torch.tensor([3, 4, 5])] * n,
        rollout_logprobs=[torch.zeros(3)] * n,
        rewards=torch.zeros(n),
        group_ids=torch.tensor([0, 0, 1, 1]),
        truncated=torch.zeros(n, dtype=torch.bool),
        token_versions=[torch.full((3,), v) for v in (7, 7, 8, 8)],
    )
    parts = split_groups(batch, 2)
    assert [[t.tolist() for t in p.token_versions or []] for p in parts] == [
        [[7, 7, 7], [7, 7, 7]],
        [[8, 8, 8], [8, 8, 8]],
    ]

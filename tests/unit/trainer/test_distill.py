"""On-policy distillation's advantage and loss against closed forms on a hand-worked
example (services/trainer/core/distill.py with core/loss.py's policy loss)."""

from __future__ import annotations

import pytest
import torch

from proto.examples import EXAMPLES
from proto.messages import Sample, TrainBatch
from services.trainer.core.distill import distill_advantages, reverse_kl_advantages
from services.trainer.core.loss import policy_loss
from services.trainer.settings import DistillConfig, LossConfig
from services.trainer.wire import batch_stats, to_tensor_batch

STUDENT = torch.tensor([-1.0, -2.0, -0.5])
TEACHER = torch.tensor([-0.5, -2.5, -0.5])
ONES = torch.ones(3)
# r = student - teacher = [-0.5, 0.5, 0.0]: the teacher likes token 0 more, token 1 less


def test_reverse_kl_advantage_is_minus_coef_times_the_logprob_gap() -> None:
    d = reverse_kl_advantages(STUDENT, TEACHER, ONES, coef=1.0, discount=0.0)
    assert d.tolist() == [0.5, -0.5, 0.0]
    d2 = reverse_kl_advantages(STUDENT, TEACHER, ONES, coef=2.0, discount=0.0)
    assert d2.tolist() == [1.0, -1.0, 0.0]


def test_discount_sums_the_later_tokens() -> None:
    # d_2 = 0; d_1 = -0.5 + 0.5 * 0 = -0.5; d_0 = 0.5 + 0.5 * -0.5 = 0.25
    d = reverse_kl_advantages(STUDENT, TEACHER, ONES, coef=1.0, discount=0.5)
    assert d.tolist() == [0.25, -0.5, 0.0]
    d1 = reverse_kl_advantages(STUDENT, TEACHER, ONES, coef=1.0, discount=1.0)
    assert d1.tolist() == [0.0, -0.5, 0.0]


def test_masked_tokens_carry_no_kl_of_their_own() -> None:
    d = reverse_kl_advantages(STUDENT, TEACHER, torch.tensor([1.0, 0.0, 1.0]), 1.0, 0.0)
    assert d.tolist() == [0.5, 0.0, 0.0]


def test_mixed_with_the_task_advantage_and_alone() -> None:
    mixed = DistillConfig(coef=1.0, reward_weight=0.5)
    assert distill_advantages(2.0, STUDENT, TEACHER, ONES, mixed).tolist() == [1.5, 0.5, 1.0]
    alone = DistillConfig(coef=1.0, reward_weight=0.0)
    assert distill_advantages(2.0, STUDENT, TEACHER, ONES, alone).tolist() == [0.5, -0.5, 0.0]


def test_the_loss_and_its_gradient_on_policy() -> None:
    """On-policy (logp = old: ratio 1) the PPO loss is -sum_t w_t A_t and its gradient in
    logp_t is -w_t A_t; with token-mean weights 1/3 and A = [1.5, 0.5, 1.0]: loss -1.0,
    gradient [-0.5, -1/6, -1/3]: the teacher-preferred token 0 is pushed up most."""
    adv = distill_advantages(2.0, STUDENT, TEACHER, ONES, DistillConfig(reward_weight=0.5))
    logp = STUDENT.clone()[None].requires_grad_(True)  # [1, 3]
    out = policy_loss(logp, STUDENT[None], adv[None], ONES[None], ONES[None] / 3, LossConfig())
    assert out.loss.item() == pytest.approx(-1.0)
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -1 / 6, -1 / 3])


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        DistillConfig(coef=0)
    with pytest.raises(ValueError):
        DistillConfig(discount=1.5)
    with pytest.raises(ValueError):
        reverse_kl_advantages(STUDENT, TEACHER[:2], ONES, 1.0, 0.0)


def test_teacher_logprobs_reach_the_tensor_batch_and_the_step_metrics() -> None:
    batch = EXAMPLES["TrainBatch"]
    assert isinstance(batch, TrainBatch)
    tb = to_tensor_batch(batch)
    samples = [s for g in batch.groups for s in g.samples]
    assert tb.teacher_logprobs is not None
    for s, t in zip(samples, tb.teacher_logprobs, strict=True):
        assert isinstance(s, Sample)
        assert (t is None) == (s.teacher_logprobs is None)
    # the example's scored sample: rollout [-0.5, -1.25, -0.125], teacher [-0.25, -2, -0.5]
    assert batch_stats(batch)["teacher_kl"] == pytest.approx((-0.25 + 0.75 + 0.375) / 3)

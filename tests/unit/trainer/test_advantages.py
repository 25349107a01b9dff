"""Advantages against hand-computed values."""

import math

import pytest
import torch

from services.trainer.core.advantages import compute_advantages

# Two groups: g0 rewards [1, 0, 0] (mean 1/3, Bessel std sqrt(1/3)), g1 [2, 4].
R = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
G = torch.tensor([7, 7, 7, 3, 3])


def test_grpo_hand_values():
    a = compute_advantages(R, G, "grpo", eps=0.0)
    s0 = math.sqrt(1 / 3)
    want = [(2 / 3) / s0, (-1 / 3) / s0, (-1 / 3) / s0, -1 / math.sqrt(2), 1 / math.sqrt(2)]
    torch.testing.assert_close(a, torch.tensor(want), atol=1e-6, rtol=0)


def test_dr_grpo_hand_values():
    a = compute_advantages(R, G, "dr_grpo")
    torch.testing.assert_close(a, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]))


def test_rloo_hand_values():
    # r_i - mean of the others: 1 - 0, 0 - 0.5, 0 - 0.5, 2 - 4, 4 - 2.
    a = compute_advantages(R, G, "rloo")
    torch.testing.assert_close(a, torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0]))


def test_singleton_and_constant_groups_get_zero():
    a = compute_advantages(torch.tensor([5.0, 1.0, 1.0]), torch.tensor([0, 1, 1]), "grpo")
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_batch_normalisation_whitens():
    a = compute_advantages(R, G, "dr_grpo", batch_normalize=True, eps=0.0)
    raw = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])
    torch.testing.assert_close(a, (raw - raw.mean()) / raw.std())
    assert abs(float(a.mean())) < 1e-6 and abs(float(a.std()) - 1) < 1e-5


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="same length"):
        compute_advantages(R, G[:2])

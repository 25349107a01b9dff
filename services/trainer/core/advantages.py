"""Group-relative advantages from per-sample rewards.

Each prompt is sampled `n` times; the `n` samples share a group id and the
group's own rewards serve as the baseline (no critic):

- GRPO (Shao et al. 2024, DeepSeekMath, eq. 3):
  A_i = (r_i - mean_g) / (std_g + eps), std with Bessel's correction
  (as TRL and verl compute it).
- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
  A_i = r_i - mean_g. Dividing by the std up-weights groups that are almost
  all right or all wrong; Dr.GRPO drops it.
- RLOO (Ahmadian et al. 2024, "Back to Basics"):
  A_i = r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) · (r_i - mean_g),
  an unbiased leave-one-out baseline.

A group of one sample has no baseline, so its advantage is 0 (it carries no
learning signal under any of the three). Optional batch normalisation then
whitens all advantages: A ← (A - mean(A)) / (std(A) + eps), as in
REINFORCE++ (Hu 2025).
"""

from __future__ import annotations

import torch

from services.trainer.settings import AdvantageEstimator


def group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and group std (Bessel) of `rewards`.

    rewards: [N] float, group_ids: [N] any integers. Returns three [N] tensors;
    the std of a group of one is 0.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [N] in 0..G-1
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    r = rewards.double()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count  # [G]
    sq_dev = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, inverse, (r - mean[inverse]) ** 2
    )
    var = sq_dev / (count - 1).clamp(min=1)  # [G]; 0 for singleton groups
    return count[inverse], mean[inverse], var.sqrt()[inverse]


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: AdvantageEstimator = "grpo",
    eps: float = 1e-6,
    batch_normalize: bool = False,
) -> torch.Tensor:
    """Advantages [N] (float32) of `rewards` [N] with groups `group_ids` [N]."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} "
            "must be 1-D and the same length"
        )
    count, mean, std = group_stats(rewards, group_ids)
    r = rewards.double()
    if estimator == "grpo":
        adv = (r - mean) / (std + eps)
    elif estimator == "dr_grpo":
        adv = r - mean
    elif estimator == "rloo":
        adv = count / (count - 1).clamp(min=1) * (r - mean)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    if batch_normalize and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + eps)
    return adv.float()

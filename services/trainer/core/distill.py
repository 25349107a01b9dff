"""On-policy distillation: the per-token reverse-KL advantage (pure).

The student samples, a teacher scores the sampled tokens, and each token's
advantage is how much more the teacher likes it than the student does
(Thinking Machines, "On-Policy Distillation", 2025; tinker-cookbook's
`incorporate_kl_penalty`):

    r_t = logp_student(x_t) - logp_teacher(x_t)       (per-token reverse KL estimate)
    d_t = -coef · r_t                                  (discount = 0)
    d_t = -coef · sum_{k >= t} discount^(k - t) · r_k   (discount > 0: the future's too)

with the rollout's logprobs as the student's (the policy that sampled the
tokens, as in the recipe). Minimising E[r] over the student's own samples
is minimising KL(student || teacher): mode-seeking, on the states the
student actually visits. The token's advantage is then

    A_t = reward_weight · A_task + d_t

with A_task the group-relative advantage of the task's reward
(core/advantages.py): `reward_weight = 0` is distillation alone, 1 mixes
it with RL. The policy loss (core/loss.py) takes A_t as any advantage:
at ratio 1 its gradient is -sum_t w_t A_t ∇logp_t.
"""

from __future__ import annotations

import torch

from services.trainer.settings import DistillConfig


def reverse_kl_advantages(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float, discount: float
) -> torch.Tensor:
    """d [R] float32: -coef · (student - teacher) per token, summed over later tokens with
    `discount` > 0. student, teacher: [R] logprobs of the sampled tokens; mask: [R], 1 on
    the tokens the policy generated (an observation token carries no KL of its own)."""
    if not student.shape == teacher.shape == mask.shape or student.dim() != 1:
        raise ValueError(
            f"student {tuple(student.shape)}, teacher {tuple(teacher.shape)} and mask "
            f"{tuple(mask.shape)} must be 1-D and the same length"
        )
    r = (student.double() - teacher.double()) * mask.double()  # [R]
    d = -coef * r
    if discount > 0 and d.numel() > 1:
        out = torch.empty_like(d)
        acc = torch.zeros((), dtype=d.dtype)
        for t in range(d.numel() - 1, -1, -1):  # suffix sums: a sample is short, this is cheap
            acc = d[t] + discount * acc
            out[t] = acc
        d = out
    return d.float()


def distill_advantages(
    task_advantage: float,
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    cfg: DistillConfig,
) -> torch.Tensor:
    """A [R]: reward_weight · task_advantage + the reverse-KL advantage, per token."""
    d = reverse_kl_advantages(student, teacher, mask, cfg.coef, cfg.discount)
    return d + cfg.reward_weight * task_advantage

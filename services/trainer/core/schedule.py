"""Learning-rate schedule: linear warmup, then constant or cosine decay.

    m(s) = (s + 1) / warmup                                   for s < warmup
    m(s) = 1                                                  constant
    m(s) = r + (1 - r) · ½ (1 + cos(π · p)),  p = (s - warmup) / (total - warmup)
                                                              cosine, r = min_lr_ratio

(the schedule of Loshchilov & Hutter 2017 without restarts, as in most LLM
recipes). `s` counts optimizer steps from 0; the multiplier scales the base LR.
"""

from __future__ import annotations

import math

from services.trainer.settings import ScheduleKind


def lr_multiplier(
    step: int, *, warmup_steps: int, total_steps: int, kind: ScheduleKind, min_lr_ratio: float
) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

"""The base learning rate: the run file's number, or `"auto"` resolved from the model's size.

`[trainer.optim] lr = "auto"` (the default) is a heuristic anchored on one
measured model and scaled like 1/sqrt(N), N the policy's parameter count:

    full fine-tuning:  lr = clamp(4e-5 · sqrt(1.35e8 / N), 1e-6, 4e-5)
    LoRA adapter:      lr = clamp(4e-4 · sqrt(1.35e8 / N), 1e-5, 4e-4)   (10x)

The anchor is measured: SmolLM2-135M-Instruct (134.5M parameters) learns
the real-model demo and a user's classification task at 4e-5 and nothing
within a run at 1e-6 (configs/demo-real.toml, bench/results_demo_real.md,
docs/learning.md: at 1e-6 the median weight's published bf16 value changes
only after ~244 same-direction steps). The 1/sqrt(N) scaling and the clamps
are NOT measured here: larger models are commonly trained at smaller rates
(1e-6, the old default, is a usual choice for 7B-class RL; "auto" gives
5.6e-6 there), and the clamps keep a tiny test model from an absurd rate and
a huge one from a rate at which its bf16 weights never move. LoRA trains at
10x full fine-tuning's rate (Thinking Machines, "LoRA Without Regret", 2025:
the best LoRA learning rate is ~10x the full one), with N the BASE model's
count. An explicit number in the run file always wins.

What "auto" gives (N as `model.parameters()` counts it: tied weights once; SmolLM2-135M's
counted from its safetensors, the others are their published sizes):

| model | N | full | LoRA |
|---|---|---|---|
| any model up to 135M (the tests' tiny ones) | ≤ 135M | 4.0e-5 (clamped) | 4.0e-4 (clamped) |
| SmolLM2-135M | 134.5M | 4.0e-5 | 4.0e-4 |
| SmolLM2-360M | 362M | 2.4e-5 | 2.4e-4 |
| Qwen2.5-0.5B | 494M | 2.1e-5 | 2.1e-4 |
| SmolLM2-1.7B | 1.71B | 1.1e-5 | 1.1e-4 |
| 7B | 7.0B | 5.6e-6 | 5.6e-5 |
| 70B | 70B | 1.8e-6 | 1.8e-5 |
| floor reached at | 216B | 1.0e-6 | 1.0e-5 |
"""

from __future__ import annotations

import math
from typing import Literal

ANCHOR_PARAMS = 1.35e8  # SmolLM2-135M, where 4e-5 was measured to learn
ANCHOR_LR = 4e-5
MIN_LR = 1e-6
LORA_FACTOR = 10.0  # "LoRA Without Regret" (2025)


def auto_lr(n_params: int, *, lora: bool) -> float:
    """The learning rate "auto" stands for, for a policy of `n_params` parameters (the
    full model's, or with `lora` the base model's)."""
    if n_params <= 0:
        raise ValueError(f"parameter count must be positive, got {n_params}")
    scale = LORA_FACTOR if lora else 1.0
    lr = scale * ANCHOR_LR * math.sqrt(ANCHOR_PARAMS / n_params)
    return min(max(lr, scale * MIN_LR), scale * ANCHOR_LR)


def resolve_lr(lr: float | Literal["auto"], n_params: int, *, lora: bool) -> float:
    """The base learning rate to train at: an explicit number as it is, "auto" from N."""
    return auto_lr(n_params, lora=lora) if lr == "auto" else float(lr)


def describe_auto_lr(lr: float, n_params: int, *, lora: bool, section: str) -> str:
    """The start-up line that says what "auto" became and how to override it."""
    kind = "LoRA adapter, base model's count" if lora else "full fine-tuning"
    return (
        f"lr auto -> {lr:.1e} ({n_params / 1e6:.1f}M parameters, {kind}); "
        f"set [{section}] lr to override"
    )

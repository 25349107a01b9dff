"""Held-out exact-match accuracy with greedy decoding (batched HF generation).

Prompts are left-padded so every row's last prompt token sits at the same
position and generation continues from it; decoding is greedy, so the
number is deterministic for a given model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.arithmetic import Problem, score


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    correct: int
    total: int
    samples: tuple[tuple[str, str, str], ...]  # first few (prompt, completion, answer)


def exact_match_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    batch_size: int = 128,
    max_new_tokens: int = 8,
    scorer: Callable[[str, str], float] = score,
) -> EvalResult:
    """Fraction of `problems` whose greedy completion the scorer accepts."""
    import torch

    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    shown: list[tuple[str, str, str]] = []
    try:
        for i in range(0, len(problems), batch_size):
            chunk = problems[i : i + batch_size]
            enc = tokenizer(
                [p.prompt for p in chunk],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            new = out[:, enc["input_ids"].shape[1] :]  # [B, new]
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            for p, t in zip(chunk, texts, strict=True):
                correct += int(scorer(t, p.answer) > 0)
                if len(shown) < 5:
                    shown.append((p.prompt, t, p.answer))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return EvalResult(correct / max(len(problems), 1), correct, len(problems), tuple(shown))

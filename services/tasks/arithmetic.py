"""The built-in arithmetic task: procedural, seeded, exactly checkable.

Problem `i` of a seed is a pure function of (seed, i), so a task id names
its problem everywhere (buffer, rollout worker, evaluation) without
shipping a dataset. The prompt is "a+b=" and the answer is the decimal
result; a completion is correct when its text before the first EOS or
newline equals the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def problem(seed: int, index: int, digits: int = 2, op: str = "+") -> Problem:
    """The `index`-th problem of `seed` with operands of `digits` digits: "a+b=" (the
    addition task) or "a*b=" (`op` "*": the tool demo's multiplication)."""
    key = f"arith:{seed}:{digits}:{index}" + ("" if op == "+" else f":{op}")
    rng = random.Random(key)
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if op == "*":
        return Problem(prompt=f"{a}*{b}=", answer=str(a * b))
    if op != "+":
        raise ValueError(f"unknown operator {op!r}")
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b))


def extract_answer(completion: str) -> str:
    """The model's answer: text up to the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


def score(completion: str, answer: str) -> float:
    """1.0 for an exact answer, else 0.0."""
    return 1.0 if extract_answer(completion) == answer else 0.0

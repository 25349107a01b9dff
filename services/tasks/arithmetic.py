"""The built-in arithmetic task: procedural, seeded, exactly checkable.

Problem `i` of a seed is a pure function of (seed, i), so a task id names
its problem everywhere (buffer, rollout worker, evaluation) without
shipping a dataset. The prompt is "a+b=" and the answer is the decimal
result; a completion is correct when its text before the first EOS or
newline equals the answer. `ArithmeticSource` is the task as a run file's
source (`source = { type = "arithmetic" }`), scored by `exact_match`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from services.tasks.registry import SOURCES, Row, Rows, SourceSpec


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


@SOURCES.register
class ArithmeticSource(SourceSpec):
    """The built-in arithmetic task ('a+b=' -> the sum), procedural and seeded."""

    default_reward: ClassVar[str | None] = "exact_match"

    type: Literal["arithmetic"]
    size: int = Field(100_000, ge=1, description="Number of distinct problems.")
    seed: int = Field(0, description="Seed of the problems.")
    digits: int = Field(2, ge=1, le=9, description="Operand digits.")
    op: Literal["+", "*"] = Field(
        "+", description="'+': addition; '*': multiplication (the tool-use demo)."
    )

    def rows(self, key: str) -> Rows:
        return ArithmeticRows(self)


@dataclass(frozen=True)
class ArithmeticRows:
    spec: ArithmeticSource

    def __len__(self) -> int:
        return self.spec.size

    def row(self, index: int) -> Row:
        p = problem(self.spec.seed, index, self.spec.digits, self.spec.op)
        return Row(prompt=p.prompt, answer=p.answer, solution=p.answer)

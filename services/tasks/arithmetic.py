"""The built-in arithmetic task: procedural, seeded, exactly checkable.

Problem `i` of a seed is a pure function of (seed, i), so a task id names
its problem everywhere (buffer, rollout worker, evaluation) without
shipping a dataset. The prompt is "a+b=" and the answer is the decimal
result; a completion is correct when its text before the first EOS or
newline equals the answer. `ArithmeticSource` is the task as a run file's
source (`source = { type = "arithmetic" }`), scored by `exact_match`.

Splits. The problem space itself is partitioned: each problem belongs to
`train`, `validation` or `test` by a hash of the problem (of its unordered
operands, so 12+34 and 34+12 fall together), whatever seed, index or
stream draws it. A source of one split draws only that split's problems
(a draw of another split is drawn again), so SFT data, RL prompts,
checkpoint selection and reported figures are disjoint by construction,
not by the luck of different seeds: 2-digit addition has only 8,100
problems, and seeds 0 and 1000003 shared 44% of the evaluation prompts.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from services.tasks.registry import SOURCES, Row, Rows, SourceSpec

Split = Literal["train", "validation", "test"]
SPLITS: tuple[Split, ...] = ("train", "validation", "test")
TEST_SHARE = 0.1
"""Share of the problem space whose problems are only ever reported on (`test`)."""
VALIDATION_SHARE = 0.1
"""Share only ever used to choose a checkpoint (`validation`); the rest train."""
MAX_DRAWS = 10_000  # a split this rare in a space this small is a bug, not bad luck


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def split_of(a: int, b: int, op: str) -> Split:
    """The split problem (a, b, op) belongs to: a hash of the problem, not of a draw."""
    lo, hi = sorted((a, b))  # both operators commute: a+b and b+a are one problem
    digest = hashlib.blake2b(f"{lo}{op}{hi}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    if u < TEST_SHARE:
        return "test"
    return "validation" if u < TEST_SHARE + VALIDATION_SHARE else "train"


def problem(
    seed: int, index: int, digits: int = 2, op: str = "+", split: Split = "train"
) -> Problem:
    """The `index`-th problem of `seed` and `split` with operands of `digits` digits:
    "a+b=" (the addition task) or "a*b=" (`op` "*": the tool demo's multiplication)."""
    if op not in ("+", "*"):
        raise ValueError(f"unknown operator {op!r}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; one of {SPLITS}")
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    key = f"arith:{seed}:{digits}:{index}" + ("" if op == "+" else f":{op}")
    for draw in range(MAX_DRAWS):
        rng = random.Random(key if draw == 0 else f"{key}:{split}:{draw}")
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if split_of(a, b, op) == split:
            answer = a * b if op == "*" else a + b
            return Problem(prompt=f"{a}{op}{b}=", answer=str(answer))
    raise ValueError(f"no {split} problem of {digits}-digit {op} in {MAX_DRAWS} draws")


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
    splits_apart: ClassVar[bool] = True  # each problem belongs to one split (split_of)

    type: Literal["arithmetic"]
    size: int = Field(100_000, ge=1, description="Number of distinct problems.")
    seed: int = Field(0, description="Seed of the problems.")
    digits: int = Field(2, ge=1, le=9, description="Operand digits.")
    op: Literal["+", "*"] = Field(
        "+", description="'+': addition; '*': multiplication (the tool-use demo)."
    )
    split: Split | None = Field(
        None,
        description="Which part of the problem space to draw from (each problem belongs to one "
        "by a hash of the problem: services/tasks/arithmetic.py). Default: by where the "
        "source stands: train for `source`, validation for `eval.source`, test for "
        "`eval.test_source`; any other choice there is refused.",
    )

    def rows(self, key: str) -> Rows:
        return ArithmeticRows(self)

    def in_split(self, split: str, key: str) -> ArithmeticSource:
        if self.split is None:
            return self.model_copy(update={"split": split})
        if self.split != split:
            raise ValueError(
                f"{key}.split: {self.split!r}, but this source is the {split} split: every "
                f"problem it draws must be one no other split draws (leave split out)"
            )
        return self


@dataclass(frozen=True)
class ArithmeticRows:
    spec: ArithmeticSource

    def __len__(self) -> int:
        return self.spec.size

    def row(self, index: int) -> Row:
        s = self.spec
        p = problem(s.seed, index, s.digits, s.op, s.split or "train")
        return Row(prompt=p.prompt, answer=p.answer, solution=p.answer)

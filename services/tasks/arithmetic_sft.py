"""SFT records of the arithmetic task: right, or wrong on purpose (the demo's warm start).

`flywheel demo` warms its tiny model up on 2-digit sums where a share of the
labels make a plausible mistake (58+67=025), so RL starts from a model that
is often wrong in one learnable way (services/stack/demo.py); the tests
train on the same records. Records are `{"prompt", "completion"}` JSON lines,
the completion shape services/trainer/sft/data.py reads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from services.tasks.arithmetic import problem


def add_without_carry(a: int, b: int) -> int:
    """Digit-wise sum mod 10 (the classic 'forgot to carry' mistake): 58 + 67 -> 15."""
    result, place = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def drop_final_carry(a: int, b: int, digits: int) -> int:
    """The sum without its carry out of the top digit: 58 + 67 -> 25."""
    return (a + b) % 10**digits


def zero_final_carry(a: int, b: int, digits: int) -> str:
    """The carry out of the top digit written as 0, at the sum's width: 58 + 67 -> 025.

    Unchanged where there is no such carry (12 + 34 -> 46).
    """
    if a + b < 10**digits:
        return str(a + b)
    return "0" + f"{drop_final_carry(a, b, digits):0{digits}d}"


# corrupt= name -> the mistake's answer for (a, b, digits)
MISTAKES: dict[str, Callable[[int, int, int], str]] = {
    "all_carries": lambda a, b, _digits: str(add_without_carry(a, b)),
    "final_carry": lambda a, b, digits: str(drop_final_carry(a, b, digits)),
    "zero_final_carry": zero_final_carry,
}


def arithmetic_records(
    n: int,
    seed: int,
    *,
    digits: int = 2,
    corrupt_fraction: float = 0.0,
    corrupt: str = "all_carries",
    start: int = 0,
) -> Iterator[dict[str, str]]:
    """prompt/completion records of problems start..start+n of `seed`.

    With `corrupt_fraction` p, each record's answer is replaced with
    probability p by a plausible mistake (unchanged where the mistake
    cannot happen): `corrupt="all_carries"` adds without any carry (58 + 67
    -> 15), `"final_carry"` drops only the carry out of the top digit
    (58 + 67 -> 25), `"zero_final_carry"` writes that carry as 0 (58 + 67 ->
    025). A warm start that is plausible but wrong, for RL to repair.
    """
    if corrupt not in MISTAKES:
        raise ValueError(f"unknown corruption {corrupt!r}; one of {sorted(MISTAKES)}")
    rng = random.Random(f"corrupt:{seed}")
    for i in range(start, start + n):
        pr = problem(seed, i, digits)
        answer = pr.answer
        if corrupt_fraction > 0 and rng.random() < corrupt_fraction:
            a, b = (int(x) for x in pr.prompt.rstrip("=").split("+"))
            answer = MISTAKES[corrupt](a, b, digits)
        yield {"prompt": pr.prompt, "completion": answer}


def write_arithmetic_jsonl(path: str | Path, n: int, seed: int, **kwargs: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        for rec in arithmetic_records(n, seed, **kwargs):
            f.write(json.dumps(rec) + "\n")
    return p

"""User functions for the task tests, imported by path (sources, custom rewards)."""

from __future__ import annotations

import time


def rows(n: int) -> list[dict[str, str]]:
    """A function source: n rows of 'i*2' -> 2i."""
    return [{"q": f"{i}*2", "answer": str(2 * i)} for i in range(n)]


def shouting(completion: str, answer: str | None, *, bonus: float = 0.0) -> dict:
    """A custom reward with parts: 1 for an upper-case completion, plus its length."""
    ok = completion.isupper()
    return {"reward": float(ok) + bonus, "parts": {"length": float(len(completion))}}


def raises(completion: str, answer: str | None) -> float:
    raise ValueError("reward bug")


def hangs(completion: str, answer: str | None) -> float:
    time.sleep(3600)
    return 1.0


def raises_on_x(completion: str, answer: str | None) -> float:
    """Raises for one completion of a group, scores the others."""
    if completion == "x":
        raise ValueError("x is not a number")
    return float(completion == answer)

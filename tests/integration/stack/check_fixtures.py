"""A reward for `flywheel check`'s tests, imported by path in the verifier sandbox."""

from __future__ import annotations


def even_sum(completion: str, answer: str | None) -> float:
    """1 when the reply's character codes sum to an even number: a random tiny model's
    replies earn it about half the time, so groups have a spread and some are right."""
    return float(sum(map(ord, completion)) % 2 == 0)

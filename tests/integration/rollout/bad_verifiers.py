"""Verifiers that misbehave, imported by path in the verifier sandbox's child processes."""

import time


def hangs(completion: str, answer: str | None) -> float:
    """Never returns (within any sane limit)."""
    time.sleep(3600)
    return 1.0


def raises(completion: str, answer: str | None) -> float:
    raise ValueError(f"cannot parse {completion!r}")


def slow_when_right(completion: str, answer: str | None) -> float:
    """Exact match, but a right answer written with a trailing space takes the checker's
    slow path and never returns: a check that times out on a right answer."""
    if completion != completion.rstrip() and completion.strip() == answer:
        time.sleep(3600)
    return float(completion == answer)

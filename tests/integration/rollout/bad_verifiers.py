"""Verifiers that misbehave, imported by path in the verifier sandbox's child processes."""

import time


def hangs(completion: str, answer: str | None) -> float:
    """Never returns (within any sane limit)."""
    time.sleep(3600)
    return 1.0


def raises(completion: str, answer: str | None) -> float:
    raise ValueError(f"cannot parse {completion!r}")

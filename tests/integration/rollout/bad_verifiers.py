"""Verifiers that misbehave, imported by path in the verifier sandbox's child processes."""

import hashlib
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


def hangs_on_half(completion: str, answer: str | None) -> float:
    """A check that hangs on about half of all completions (those whose digest's first byte
    is even) and scores the rest by another byte of it, spread over [0, 1]: a group of
    sampled completions gets both, whichever text the engine made."""
    digest = hashlib.sha256(completion.encode()).digest()
    if digest[0] % 2 == 0:
        time.sleep(3600)
    return digest[1] / 255

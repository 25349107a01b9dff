"""Verifiers for the sandbox tests, imported by path in the verifier's child process."""

from __future__ import annotations

import os
import time


def hang(completion: str, answer: str) -> float:
    """Never returns on its own (a verifier stuck in a loop)."""
    while True:
        time.sleep(0.05)


def boom(completion: str, answer: str) -> float:
    raise ValueError("verifier bug")


def die(completion: str, answer: str) -> float:
    os._exit(3)


def length_reward(completion: str, answer: str) -> tuple[float, dict[str, float]]:
    """A custom verifier with reward parts."""
    return float(len(completion) == len(answer)), {"length": float(len(completion))}

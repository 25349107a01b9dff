"""User tools for the tests: one that works, one that raises, one that hangs."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    return a + b


def boom() -> str:
    raise RuntimeError("the tool broke")


def hang() -> str:
    time.sleep(3600)
    return "never"

"""Run in a sandbox child's zygote as a warm-up (test_declared.py): which modules it holds."""

from __future__ import annotations

import sys


def holds(modules: list[str]) -> float:
    """1.0 when every module of `modules` was imported before this warm-up; raises if not."""
    missing = [m for m in modules if m not in sys.modules]
    if missing:
        raise ImportError(f"not imported before the warm-up: {missing}")
    return 1.0

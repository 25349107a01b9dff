"""A module whose import takes longer than the preload test's time limit (test_preload.py)."""

import time

time.sleep(1.5)


def loaded(completion: str, answer: str | None) -> float:
    return 1.0

"""The stage timer the trainer's metrics rows use (bench/e2e.py --profile reads them)."""

from __future__ import annotations

import time

import pytest

from services.trainer.stopwatch import Stopwatch


def test_stages_sum_and_take_restarts() -> None:
    w = Stopwatch()
    for _ in range(2):
        with w("a"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), w("b"):  # a stage that raises still counts
        raise RuntimeError("boom")
    got = w.take()
    assert set(got) == {"time_a_s", "time_b_s"}
    assert got["time_a_s"] >= 0.02 and got["time_b_s"] >= 0
    assert w.take() == {}

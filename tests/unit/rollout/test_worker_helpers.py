"""Rollout worker helpers: engine versions and loads as SGLang reports them."""

from __future__ import annotations

from services.rollout.worker import load_counts, parse_version


def test_engine_versions() -> None:
    assert parse_version("12") == 12
    assert parse_version(3) == 3
    assert parse_version("default") == 0  # SGLang's initial weights
    assert parse_version(None) == 0


def test_loads_sum_over_ranks() -> None:
    loads = {"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1},
                       {"num_running_reqs": 2, "num_waiting_reqs": 0}]}  # fmt: skip
    assert load_counts(loads) == (5, 1)
    assert load_counts({}) == (0, 0)

"""bench/fleet.py runs: two synthetic engines behind the real engine app, their
workers, the buffer, NATS and the stand-in trainer move groups and nobody dies.

The bench's engines implement the scheduler's interface without a model; when
that interface changes (it did: weight loaders), the bench breaks without any
other test noticing. This is the check that it still measures something.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet import main

pytestmark = pytest.mark.slow


def test_a_small_fleet_moves_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--n", "2", "--seconds", "4", "--warmup-s", "2", "--work-dir", str(tmp_path)]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert row["dead"] == [], logs
    assert row["groups_per_s"] > 0 and row["p50"] is not None, (row, logs)
    # the stand-in trainer was alive and working in the window (reading batches); that
    # groups still flow after warm-up at k = 1 is what says its versions reached the engines
    assert row["cpu"]["trainer"] > 0

"""The core lease (services/runtime/cores.py): the rule, the directory, the idle clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.cores import BusyClock, CoreLease, CoreLeaseSettings, threads_for


@pytest.mark.parametrize(
    ("total", "share", "others", "want"),
    [(2, 1, 0, 2), (2, 1, 1, 1), (2, 1, 2, 1), (8, 1, 1, 4), (8, 2, 7, 2), (4, 1, 2, 1)],
)
def test_busy_roles_split_the_cores_never_below_their_share(
    total: int, share: int, others: int, want: int
) -> None:
    assert threads_for(total, share, others) == want


def test_a_role_alone_at_work_gets_every_core_and_a_dead_one_lends_its_own(tmp_path: Path) -> None:
    s = CoreLeaseSettings(dir=tmp_path / "cores", total=2)
    trainer, engine = CoreLease(s, "trainer"), CoreLease(s, "engine-0")
    engine.mark(True)
    assert engine.threads() == 2  # the trainer waits: the engine computes with its core
    assert trainer.threads() == 1  # a batch comes: the trainer starts on its share
    trainer.mark(True)
    assert (trainer.threads(), engine.threads()) == (1, 1)
    trainer.mark(False)
    assert engine.threads() == 2
    # a role whose process died while busy: its file stays, its cores do not
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (tmp_path / "cores" / "engine-1").write_text(f"{dead} busy\n")
    assert engine.threads() == 2
    engine.close()
    assert not (tmp_path / "cores" / "engine-0").exists()


def test_busy_clock_counts_wall_time_without_work() -> None:
    assert BusyClock().idle_fraction() == 0.0  # before any work: nothing measured
    first = BusyClock()
    first.busy(now=5.0)
    first.idle(now=6.0)
    assert first.idle_fraction(now=7.0) == pytest.approx(0.5)  # counted from the first work
    c = BusyClock(started=0.0)
    c.busy(now=1.0)
    c.idle(now=4.0)
    assert c.idle_fraction(now=10.0) == pytest.approx(0.7)
    c.busy(now=10.0)
    assert c.idle_fraction(now=20.0) == pytest.approx(0.35)

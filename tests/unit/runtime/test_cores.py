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


def test_only_cores_nobody_runs_on_are_lent() -> None:
    assert threads_for(8, 1, 0, free=3) == 3
    assert threads_for(2, 1, 0, free=0) == 1  # a busy machine: the share, never less


def quiet(lease: CoreLease, others: int = 0) -> CoreLease:
    """The lease on a machine where, besides the reader, `others` threads run."""
    lease.runnable = lambda: 1 + others
    return lease


def test_a_role_alone_at_work_gets_every_core_and_a_dead_one_lends_its_own(tmp_path: Path) -> None:
    s = CoreLeaseSettings(dir=tmp_path / "cores", total=2)
    trainer, engine = quiet(CoreLease(s, "trainer")), quiet(CoreLease(s, "engine-0"))
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
    # someone else's work on the machine: the idle trainer's core is not free to lend
    assert quiet(engine, others=2).threads(mine=1) == 1  # its own thread and a stranger
    assert quiet(engine, others=1).threads(mine=0) == 1
    assert quiet(engine, others=1).threads(mine=1) == 2  # only its own: not someone else's
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

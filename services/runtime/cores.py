"""Cores lent between roles on one machine: the colocated placement on a CPU.

On a small machine the trainer and the engines share the cores, and each
waits for the other: the trainer for a batch, the engines (once they are
`max_staleness` versions ahead) for the trainer's next version. With a fixed
split, the waiting role's cores idle. A *core lease* lets them move: every
role on the machine says whether it has work, and each role computes with

    threads = max(share, total // busy roles)      (itself counted as busy)

so a role alone at work gets every core, and roles that all work get their
share each. A core is lent only while nothing else runs on it (the machine's
runnable threads, /proc/loadavg): on a machine shared with other work a
lent thread waits for a descheduled partner at every parallel op, and the
role computes slower with two threads than with one (measured:
bench/results_placement.md). The decision is a pure function (`threads_for`); the state is a
directory of one small file per role (`<dir>/<role>`: its pid and `busy` or
`idle`), written atomically, and only when the role's state changes. A file
whose pid is gone counts as idle, so a crashed role lends its cores instead
of holding them. Nothing here talks to another service: `flywheel up` (the
owner of the machine's processes) makes the directory and tells each role
where it is (`[trainer] cores`, `[rollout] cores`); the trainer applies the
count to its own compute thread, a rollout worker to its engine (through
the CPU engine's thread hook, its own HTTP API).

`BusyClock` measures what the lease decides from, always, lease or not: the
fraction of wall time a role had no work (the trainer's and the engines'
idle fractions, before and after lending).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

BUSY, IDLE = "busy", "idle"


class CoreLeaseSettings(BaseModel):
    """`[<service>.cores]`: the machine's core lease (set by `flywheel up` when `[stack]
    placement` is colocated; off unless `dir` is given)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path | None = Field(
        None, description="The lease directory, one per machine and run (None: no lending)."
    )
    total: int = Field(0, ge=0, description="Cores lent around (0: this machine's count).")
    share: int = Field(
        1, ge=1, description="Threads this role computes with while every role has work."
    )
    poll_s: float = Field(
        0.25, gt=0, le=10, description="How often the other roles' states are read."
    )

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def cores(self) -> int:
        return self.total or os.cpu_count() or 1


def threads_for(total: int, share: int, busy_others: int, free: int | None = None) -> int:
    """Threads for a role with work when `busy_others` other roles have work too, and at
    most `free` cores nobody else runs on (None: unknown, not a limit)."""
    n = max(share, total // (busy_others + 1))
    return n if free is None else max(share, min(n, free))


def runnable_threads() -> int | None:
    """Threads running or ready to run on this machine now (/proc/loadavg's 4th field),
    the reader included; None where there is no /proc."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


class CoreLease:
    """One role's handle on the lease directory (module docstring)."""

    def __init__(self, settings: CoreLeaseSettings, role: str) -> None:
        assert settings.dir is not None, "a lease needs its directory"
        self.settings = settings
        self.dir = settings.dir
        self.role = role
        self.pid = os.getpid()
        self._state: str | None = None
        self.runnable = runnable_threads  # what runs on the machine (a test gives its own)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mark(False)

    def mark(self, busy: bool) -> None:
        """Say whether this role has work (a file write only when that changes)."""
        state = BUSY if busy else IDLE
        if state == self._state:
            return
        tmp = self.dir / f".{self.role}.{self.pid}.tmp"
        tmp.write_text(f"{self.pid} {state}\n")
        os.replace(tmp, self.dir / self.role)
        self._state = state

    def busy_others(self) -> int:
        """Other roles with work now (unreadable or dead ones do not count)."""
        n = 0
        for entry in os.scandir(self.dir):
            if entry.name == self.role or entry.name.startswith("."):
                continue
            try:
                pid_text, state = Path(entry.path).read_text().split()
                pid = int(pid_text)
            except (OSError, ValueError):
                continue  # being replaced, or not a lease file: not a busy role
            if state == BUSY and _alive(pid):
                n += 1
        return n

    def threads(self, mine: int = 0) -> int:
        """What this role should compute with now, if it has work; `mine`: the threads it
        runs with now (not someone else's). A core is lent only while no one runs on it:
        the machine's runnable threads, less the reader and `mine`, bound the count."""
        s = self.settings
        total = s.cores()
        running = self.runnable()
        free = None if running is None else total - max(0, running - 1 - mine)
        return threads_for(total, s.share, self.busy_others(), free)

    def close(self) -> None:
        """Leave the lease: this role's cores are everyone's."""
        try:
            (self.dir / self.role).unlink()
        except FileNotFoundError:
            pass


class BusyClock:
    """Wall time with and without work, from the transitions (`busy`, `idle`), counted from
    `started` (default: the first `busy`, so a role's start-up is not its idleness)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = started
        self.busy_s = 0.0
        self.busy_since: float | None = None

    def busy(self, now: float | None = None) -> None:
        if self.busy_since is None:
            self.busy_since = time.monotonic() if now is None else now
            if self.started is None:
                self.started = self.busy_since

    def idle(self, now: float | None = None) -> None:
        if self.busy_since is not None:
            t = time.monotonic() if now is None else now
            self.busy_s += t - self.busy_since
            self.busy_since = None

    def idle_fraction(self, now: float | None = None) -> float:
        """0.0 before any work (nothing measured yet: not idle time)."""
        if self.started is None:
            return 0.0
        t = time.monotonic() if now is None else now
        busy = self.busy_s + (t - self.busy_since if self.busy_since is not None else 0.0)
        wall = t - self.started
        return 1.0 - busy / wall if wall > 0 else 0.0

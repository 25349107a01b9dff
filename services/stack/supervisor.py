"""Supervise the local stack's processes: start in order, watch, restart or stop.

Each process's stdout+stderr goes to `<run_dir>/logs/<name>.log`. The console
(`[name]`-prefixed) gets only what a user must act on: warnings, errors and
tracebacks (`for_console`); a service's INFO lines stay in its log file, where
an operator reads them, and `verbose` sends every line to the console as well
(no console at all: `flywheel up --quiet`). A process
counts as started once its ready URL answers 200 (`/readyz` of a service,
`/health_generate` of an engine: a real one-token generation, which takes
a second or more on SGLang and on the CPU engine alike). A process that
exits on its own is reported by name with the tail of its log, then
restarted (up to `max_restarts`) or the whole stack stops, as configured;
one whose spec `finishes` (the trainer given max_steps) and exits 0 has
done its work, and the stack stops without a failure; so does any process
that exits with `EXIT_DONE` (`RunDone`: the buffer's whole training set
solved, `[buffer] on_solved = "stop"`), after saying why.
Stopping sends SIGTERM in reverse start order, then SIGKILL after a grace
period.

`pids_file` (`flywheel up` writes `<run_dir>/pids.json`) maps each process
name to its current pid and is rewritten, atomically, on every (re)start:
an operator, or the chaos suite (tests/chaos), can signal one service of a
running stack without guessing from `ps`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from services.runtime.errors import (
    EXIT_CONFIG,
    EXIT_DONE,
    EXIT_HALTED,
    EXIT_MISSING,
    FlywheelError,
)
from services.runtime.msgloop import pause
from services.stack.plan import ProcSpec

log = logging.getLogger(__name__)

TAIL_LINES = 30
FINAL = (EXIT_CONFIG, EXIT_HALTED, EXIT_MISSING)  # exit codes after which a restart cannot help


# A record of a service's own logging (services/runtime/lifecycle.py setup_logging):
# `2026-11-27T09:20:00.123Z buffer INFO services.buffer.app: message`.
RECORD = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z \S+ ([A-Z]+) ")
ACT_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})
# What must reach the console in output that is not one of those records: another
# program's warning or error (torchrun, SGLang), a traceback, a service's exit error
# (`flywheel buffer: ...`). Upper case only: Python's `UserWarning:` lines are a
# library's notes to its developers, not something the user can act on.
ACT_LINE = re.compile(
    r"\b(?:WARNING|ERROR|CRITICAL|FATAL)\b|^Traceback \(most recent call last\)|^flywheel \S+: "
)


def for_console(line: str, after_shown: bool) -> bool:
    """Whether the console shows `line` of a service's output (not verbose).

    A service's log record shows by its level (WARNING and above); any other line
    shows if it says WARNING/ERROR, starts a traceback or is a `flywheel <service>:`
    exit error, and otherwise goes with the line before it (`after_shown`): the
    traceback or the continued message of the record it belongs to.
    """
    m = RECORD.match(line)
    if m is not None:
        return m.group(1) in ACT_LEVELS
    return ACT_LINE.search(line) is not None or after_shown


class StackError(FlywheelError, RuntimeError):
    """A service could not be started, or died and may not be restarted."""


@dataclass
class Proc:
    spec: ProcSpec
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    pump: asyncio.Task[None] | None = None
    shown: bool = False  # whether the console showed its last line (for_console)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


async def http_ok(url: str, timeout_s: float = 30.0) -> bool:
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s,
            s.get(url) as r,
        ):
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def _write_json(path: Path, doc: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it if the supervisor dies, even by SIGKILL,
    so a killed `flywheel up` leaves no orphaned services behind (Linux prctl)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _in_child(cpus: tuple[int, ...]) -> Callable[[], None]:
    """What the child runs before exec: die with the parent, and its `[stack] cpus`
    (set before exec, so every thread it ever starts inherits them)."""

    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class Supervisor:
    def __init__(
        self,
        specs: list[ProcSpec],
        log_dir: Path,
        *,
        on_failure: str = "restart",
        max_restarts: int = 5,
        ready_timeout_s: float = 180.0,
        stop_grace_s: float = 15.0,
        console: TextIO | None = sys.stdout,
        verbose: bool = False,
        pids_file: Path | None = None,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = [Proc(s, log_dir / f"{s.name}.log") for s in specs]
        self.on_failure = on_failure
        self.max_restarts = max_restarts
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.console = console
        self.verbose = verbose  # every line to the console, not only what to act on
        self.pids_file = pids_file
        self.failed: str | None = None  # why the stack stopped on its own
        self.finished: str | None = None  # a process that finished its work ended the run

    def get(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    async def _pump(self, p: Proc) -> None:
        assert p.proc is not None and p.proc.stdout is not None
        with p.log_path.open("a", encoding="utf-8") as f:
            async for raw in p.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                f.write(line + "\n")
                f.flush()
                p.tail.append(line)
                p.shown = self.verbose or for_console(line, p.shown)
                if self.console is not None and p.shown:
                    self.console.write(f"[{p.name}] {line}\n")

    async def spawn(self, p: Proc) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **p.spec.env}
        p.proc = await asyncio.create_subprocess_exec(
            *p.spec.argv,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches us only; we stop children in order
            preexec_fn=_in_child(p.spec.cpus) if sys.platform == "linux" else None,
        )
        p.started_at = time.time()
        p.pump = asyncio.create_task(self._pump(p))
        self._write_pids()

    def _write_pids(self) -> None:
        """`{name: pid}` of every process started so far, and beside it `procs.json`
        (pid, restarts, metrics and ready URLs); each replaced atomically (rename)."""
        if self.pids_file is None:
            return
        started = [p for p in self.procs if p.proc is not None]
        procs = {
            p.name: {
                "pid": p.proc.pid,
                "restarts": p.restarts,
                "metrics_url": p.spec.metrics_url,
                "ready_url": p.spec.ready_url,
            }
            for p in started
            if p.proc is not None
        }
        _write_json(self.pids_file, {name: d["pid"] for name, d in procs.items()})
        _write_json(self.pids_file.with_name("procs.json"), procs)

    async def wait_ready(self, p: Proc) -> None:
        if p.spec.ready_url is None:
            return
        deadline = time.monotonic() + self.ready_timeout_s
        while not await http_ok(p.spec.ready_url):
            if not p.alive and p.spec.finishes and p.proc is not None and p.proc.returncode == 0:
                return  # done before we saw it ready (resumed at max_steps): watch ends the run
            if not p.alive:
                raise StackError(self._death_report(p, "exited before it was ready"))
            if time.monotonic() > deadline:
                raise StackError(self._death_report(p, f"not ready after {self.ready_timeout_s}s"))
            await asyncio.sleep(0.2)

    def _death_report(self, p: Proc, what: str) -> str:
        code = p.proc.returncode if p.proc else None
        tail = "\n".join(f"    {line}" for line in p.tail) or "    (no output)"
        return f"{p.name} {what} (exit code {code}); last lines of {p.log_path}:\n{tail}"

    async def start_all(self) -> None:
        """Start every process in order, each once its predecessors of other kinds are ready.
        A process planned beside another (a rollout worker beside its engine) starts with
        it: it waits for its engine itself, so their start-ups overlap."""
        kinds: list[str] = []
        for p in self.procs:
            if p.spec.kind not in kinds:
                kinds.append(p.spec.kind)
        started: set[str] = set()
        for kind in kinds:
            group = [p for p in self.procs if p.spec.kind == kind and p.name not in started]
            names = {p.name for p in group}
            group += [p for p in self.procs if p.spec.beside in names and p.name not in started]
            if not group:
                continue
            for p in group:
                await self.spawn(p)
                started.add(p.name)
            await asyncio.gather(*(self.wait_ready(p) for p in group))
            log.info("stack: %s ready", ", ".join(p.name for p in group))

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: restart (or give up on) processes that exit on their own."""
        while not stop.is_set():
            for p in self.procs:
                if p.proc is None or p.alive:
                    continue
                if p.pump is not None:
                    await p.pump
                code = p.proc.returncode
                if code == 0 and p.spec.finishes:
                    self.finished = f"{p.name} finished"
                    stop.set()
                    return
                if code == EXIT_DONE:  # RunDone: its work is done (it said why): the run's end
                    self.finished = f"{p.name} ended the run"
                    stop.set()
                    return
                if code in FINAL:
                    # The service says restarting cannot help (a bad setting, a systematic
                    # error): stop the run with its own words, not a restart loop.
                    self.failed = f"{p.name} stopped the run:\n{self._cause(p)}"
                    print(f"\nflywheel up: {self.failed}\n", file=sys.stderr, flush=True)
                    stop.set()
                    return
                report = self._death_report(p, "died")
                print(f"\nflywheel up: {report}\n", file=sys.stderr)
                if self.on_failure == "restart" and p.restarts < self.max_restarts:
                    p.restarts += 1
                    print(
                        f"flywheel up: restarting {p.name} ({p.restarts}/{self.max_restarts})",
                        file=sys.stderr,
                    )
                    await self.spawn(p)
                else:
                    self.failed = report
                    stop.set()
                    return
            await pause(stop, 0.5)

    def _cause(self, p: Proc) -> str:
        """The service's last words: its `flywheel <service>: …` lines (its exit error)."""
        lines = list(p.tail)
        start = next(
            (i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("flywheel ")), None
        )
        cause = lines[start:] if start is not None else lines[-5:]
        return "\n".join(f"  {line}" for line in cause) + f"\n  (log: {p.log_path})"

    async def stop_all(self) -> None:
        for p in reversed(self.procs):
            if p.alive and p.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for p in reversed(self.procs):
            if p.proc is None:
                continue
            remaining = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.wait_for(p.proc.wait(), remaining)
            except TimeoutError:
                print(f"flywheel up: {p.name} ignored SIGTERM; killing it", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    p.proc.kill()
                await p.proc.wait()
            if p.pump is not None:
                await p.pump

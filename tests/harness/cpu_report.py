"""CPU seconds per test module, for keeping `make test` under its time on 2 cores.

`make test` is CPU-bound on 2 cores (its processes' user + system time is close
to twice its wall time), so what shortens it is less CPU, and wall-clock
durations (`--durations`) cannot say which module spends it: under xdist
they mostly measure the other workers' load. This plugin, loaded with
`-p tests.harness.cpu_report` and `FLYWHEEL_CPU_REPORT=FILE`, appends one line
per test phase: node id, phase, CPU seconds of the worker and of the processes
it reaped (the stacks' services, engines, nats-servers: a module's stack is
counted in the phase that stops it), wall seconds. `bench/suite_cpu.py FILE`
sums them per module.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Generator
from typing import TypeAlias

import pytest

Phase: TypeAlias = Generator[None, object, object]


def cpu_seconds() -> float:
    """User + system time of this process and of every descendant it has reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def _record(item: pytest.Item, phase: str, cpu: float, wall: float) -> None:
    path = os.environ.get("FLYWHEEL_CPU_REPORT")
    if path:
        with open(path, "a") as f:  # one short line per write: workers append safely
            f.write(f"{item.nodeid}\t{phase}\t{cpu:.3f}\t{wall:.3f}\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Phase:
    return (yield from _wrap(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Phase:
    return (yield from _wrap(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Phase:
    return (yield from _wrap(item, "teardown"))


def _wrap(item: pytest.Item, phase: str) -> Phase:
    cpu, wall = cpu_seconds(), time.monotonic()
    try:
        return (yield)
    finally:
        _record(item, phase, cpu_seconds() - cpu, time.monotonic() - wall)

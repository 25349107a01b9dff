"""Blocking work off the event loop, on a thread the OS runs only when the cores are idle.

The trainer's held-out evaluations run beside its steps (services/trainer/
evaluating.py). On a machine whose cores the engines and the training step
already fill (a 2-core CPU run), an evaluation at the same priority takes
its share of the cores from them: on the ticket-routing run a k = 4
evaluation slowed the steps beside it by ~40% (bench/results_learning.md).
A thread at nice 19 gets a core when no nice-0 thread wants it (CFS weighs
nice 19 at 15 against nice 0's 1024), so the evaluation runs in the idle
time between the steps and the engine's batches, and takes longer instead.

Linux applies `setpriority(PRIO_PROCESS, tid, n)` to the one thread `tid`,
and threads it starts inherit it (torch's OpenMP team for an evaluation with
more than one thread). Raising the nice value needs no privilege; lowering
it again does, so the pool's thread is never handed other work.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

# asyncio.to_thread's shape: run fn(*args, **kwargs) on a thread, await its result
Offload = Callable[..., Awaitable[Any]]


def _lower_priority(nice: int) -> None:
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(now, nice))
    except OSError as e:  # a platform without per-thread priorities: same priority, said once
        log.warning("could not lower thread %d's CPU priority to nice %d: %s", tid, nice, e)


def niced_pool(nice: int, name: str) -> ThreadPoolExecutor:
    """One worker thread at CPU priority `nice` (0: the process's own), made on first use."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,)
    )


def offload_to(pool: ThreadPoolExecutor) -> Offload:
    """An `Offload` that runs on `pool` (asyncio.to_thread runs on the loop's default pool,
    which the training step shares)."""

    async def run(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(pool, call)

    return run


def thread_nice() -> int:
    """The calling thread's nice value (the tests read it back)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

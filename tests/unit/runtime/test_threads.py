"""The low-priority thread the trainer's evaluations run on (services/runtime/threads.py):
a real thread, its nice value read back from the kernel."""

from __future__ import annotations

import asyncio

from services.runtime.threads import niced_pool, offload_to, thread_nice


def test_the_pool_thread_runs_at_the_nice_asked_and_the_caller_keeps_its_own() -> None:
    before = thread_nice()
    pool = niced_pool(19, "test-niced")
    try:
        assert pool.submit(thread_nice).result(timeout=10) == 19
        assert thread_nice() == before  # per thread: the process and its caller unchanged
    finally:
        pool.shutdown()


def test_nice_0_leaves_the_thread_at_the_process_priority() -> None:
    pool = niced_pool(0, "test-plain")
    try:
        assert pool.submit(thread_nice).result(timeout=10) == thread_nice()
    finally:
        pool.shutdown()


def test_offload_to_runs_the_call_with_its_arguments_on_the_pool_thread() -> None:
    pool = niced_pool(19, "test-offload")
    run = offload_to(pool)

    def where(a: int, *, b: int) -> tuple[int, int]:
        return a + b, thread_nice()

    try:
        assert asyncio.run(run(where, 2, b=3)) == (5, 19)
    finally:
        pool.shutdown()

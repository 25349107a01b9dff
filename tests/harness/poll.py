"""Waiting with a deadline: poll a condition, fail with what was awaited. Never a fixed sleep.

`wait_for` is for plain test code (processes, files, HTTP); `eventually` for
async test bodies; `run_async` runs such a body in a fresh event loop with
an overall deadline, so no event-loop plugin is needed.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.1) -> T:
    """Poll `check` until it returns something true, and return that; AssertionError
    naming `what` at the deadline. `check` may raise to fail early (a process died).

    The polls back off from `poll_s` to 1 s, and the pause after a check is at least
    four times what the check took. A check that reads a whole stream costs ~0.1 CPU s
    once a stack has run for a while, and `make test` is CPU-bound: polled every
    0.1 s, such a wait took half a core from the stacks it was waiting on."""
    deadline = time.monotonic() + timeout_s
    pause, longest = poll_s, max(poll_s, 1.0)
    while True:
        began = time.monotonic()
        value = check()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(min(max(pause, 4 * (now - began)), max(deadline - now, 0.0) + 0.01))
        pause = min(pause * 1.5, longest)


async def eventually(
    check: Callable[[], Awaitable[object] | object],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
) -> None:
    """Poll `check` (sync or async) until it is true; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s: {check}")
        await asyncio.sleep(interval_s)


def run_async(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """Run an async test body in a fresh event loop, with an overall deadline."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())

"""Completions handed from the scheduler thread to the loop: all delivered, wake-ups coalesced."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from services.engine.handoff import Handoff


def test_a_batch_of_completions_wakes_the_loop_once(run_async: Any) -> None:
    async def body() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(*args: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return real(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        futs: list[asyncio.Future[int]] = [loop.create_future() for _ in range(64)]
        cancelled = futs[5]
        cancelled.cancel()  # a caller that hung up: no answer, no error
        # One decode step finishing every row: the scheduler thread hands all over.
        t = threading.Thread(target=lambda: [handoff.put(f, i) for i, f in enumerate(futs)])
        t.start()
        t.join()
        live = [f for f in futs if f is not cancelled]
        results = list(await asyncio.gather(*live))
        handoff.put(fut := loop.create_future(), 99)  # the next batch wakes it again
        results.append(await fut)
        return results, wakeups

    results, wakeups = run_async(body(), timeout_s=10)
    assert results == [i for i in range(64) if i != 5] + [99]
    assert wakeups == 2

"""The one way a service loop sleeps: until stop, until woken, or until a timeout.

Every loop outside the message loop (the buffer's dispatcher, sync's
reconciler, the rollout worker's heartbeat and weights fetcher, waiting
for an engine) pauses between rounds the same way: at most `timeout_s`,
less if the service is stopping or something happened that the next round
should see at once. Written once so none of them can forget the stop
event (and keep a stopping service alive for a whole interval).
"""

from __future__ import annotations

import asyncio


async def pause(stop: asyncio.Event, timeout_s: float, wake: asyncio.Event | None = None) -> None:
    """Return after `timeout_s`, or as soon as `stop` (or `wake`) is set.

    Does not clear `wake`: a loop clears it before the round whose result
    it would make stale, so a wake-up during the round is not lost.
    """
    waits = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waits.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()

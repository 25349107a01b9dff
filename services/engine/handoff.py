"""Completions from the scheduler thread to the event loop: one wake-up per batch, not per row.

`loop.call_soon_threadsafe` writes a byte to the loop's self-pipe every
time, and the loop then runs one iteration (an epoll wake-up) to read it.
A decode step often finishes many rows at once (a group's completions all
stop near the same length), so handing each over on its own cost a write in
the scheduler thread and a wake-up in the loop per completion. Here the
first completion of a batch schedules one drain and the rest join the list
it will take; the answers are the same, in the same order.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class Handoff:
    """Resolve asyncio futures of one loop from another thread, coalescing wake-ups."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._ready: list[tuple[asyncio.Future[Any], Any]] = []

    def put(self, fut: asyncio.Future[Any], result: Any) -> None:
        """Called from any thread: `fut` gets `result` on the loop, soon."""
        with self._lock:
            self._ready.append((fut, result))
            first = len(self._ready) == 1
        if first:  # later ones find the drain already scheduled (the list is not empty)
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for fut, result in ready:
            if not fut.done():  # a caller that went (cancelled) needs no answer
                fut.set_result(result)

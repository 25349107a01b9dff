"""In-progress acks for long handlers, from one timer per loop."""

from __future__ import annotations

import asyncio
import logging
import time

from services.runtime.msgloop.delivery import Delivery

log = logging.getLogger(__name__)


class Heartbeats:
    """In-progress acks for every handler of one loop that runs past `interval_s`.

    One timer per loop, not one per message: arming and cancelling a timer
    costs ~2 µs (measured; plus the cancelled handles left in the event
    loop's heap), paid by every message although most handlers finish long
    before the first beat. Here a message costs a dict insert and delete;
    the timer ticks every `interval_s / 2` while any handler runs and beats
    each delivery whose last beat (or start) is `interval_s` old, so beats
    are `interval_s` to `1.5 · interval_s` apart — under ack_wait for the
    default interval of ack_wait / 3. Idle, the timer is not re-armed.
    """

    def __init__(self, interval_s: float, service: str) -> None:
        self.interval_s = interval_s
        self.service = service
        self._last: dict[Delivery, float] = {}  # running delivery → its start or last beat
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()  # strong refs until they finish

    def add(self, delivery: Delivery, now: float) -> None:
        """`delivery`'s handler started at `now` (time.perf_counter)."""
        self._last[delivery] = now
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s / 2, self._tick)

    def discard(self, delivery: Delivery) -> None:
        self._last.pop(delivery, None)

    def _tick(self) -> None:
        self._timer = None
        if not self._last:
            return  # idle: the next add() re-arms
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        for delivery, last in self._last.items():
            if now - last >= self.interval_s:
                self._last[delivery] = now  # same key: safe while iterating
                task = loop.create_task(self._send(delivery))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)
        self._timer = loop.call_later(self.interval_s / 2, self._tick)

    async def _send(self, delivery: Delivery) -> None:
        try:
            await delivery.in_progress()
        except Exception as e:  # noqa: BLE001 (a missed beat only risks a redelivery)
            log.warning("%s: in-progress ack failed: %s", self.service, e)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

"""Dead letters for what the server stopped redelivering, even when it said so while we were down.

A message whose handler crashed the process, hung past ack_wait or lost its
ack is redelivered until the consumer's max_deliver, then parked without a
word to the consumer. nats-server announces it once, on the core subject
`$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`; for a pull
consumer that happens when the next pull request arrives after the last
delivery's ack wait, from whichever client sends it. A core message is heard
only by who listens at that instant: not by a service that is down (its
other replica, an operator's `nats consumer next`, or its own pull request
left behind by the killed process triggers it), nor by one that dies between
hearing it and storing the dead letter. Then the message was never
dead-lettered.

So the run's ADVISORIES stream (proto/streams.py) stores every such notice
when the server sends it, and each loop reads its own consumer's notices
through a durable consumer (`advisory_consumer`, shared by a service's
replicas): at start, whatever was stored while it was down; afterwards,
woken by a core subscription to the same subject, with a poll every
`POLL_S` as the backstop. A notice is acked only after its dead letter is
stored (id `dlq:<stream>:<consumer>:<seq>`, so one stored twice is kept once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from proto.streams import advisory_consumer
from services.runtime.errors import JetStreamMissing
from services.runtime.missing import not_found_missing
from services.runtime.msgloop.wait import pause

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

    from proto.streams import ConsumerSpec

log = logging.getLogger(__name__)

POLL_S = 30.0
"""Read the notices again this often even without a wake-up (a missed core message)."""

DeadLetterFn = Callable[[str, bytes, int, int], Awaitable[None]]
"""(subject, payload, deliveries, stream sequence) -> the dead letter is stored."""


class MaxDeliveries:
    """Dead-letters `consumer`'s messages from the max-deliveries notices in ADVISORIES."""

    def __init__(
        self,
        js: JetStreamContext,
        nc: Client,
        consumer: ConsumerSpec,
        dead_letter: DeadLetterFn,
        service: str,
    ) -> None:
        self.js, self.nc = js, nc
        self.consumer = consumer
        self.spec = advisory_consumer(consumer)
        self.dead_letter = dead_letter
        self.service = service
        self._wake = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: handle the stored notices, then wait for the next."""
        from services.runtime.nats_streams import ensure_consumer

        await ensure_consumer(self.js, self.spec)
        sub = await self.js.pull_subscribe_bind(durable=self.spec.durable, stream=self.spec.stream)
        wake = await self.nc.subscribe(self.spec.filter_subject, cb=self._on_notice)
        try:
            while not stop.is_set():
                self._wake.clear()
                await self._drain(sub)
                await pause(stop, POLL_S, self._wake)
        finally:
            for s in (sub, wake):
                with contextlib.suppress(Exception):  # closing: NATS may already be away
                    await s.unsubscribe()

    async def _on_notice(self, _msg: Msg) -> None:
        self._wake.set()

    async def _drain(self, sub: Any) -> None:
        """Handle every stored notice (NATS away: the next round tries again)."""
        from nats.errors import Error as NatsError
        from nats.errors import TimeoutError as NatsTimeout

        while True:
            try:
                notices = await sub.fetch(10, timeout=0.5)
            except (TimeoutError, NatsTimeout):
                return  # none left
            except (NatsError, OSError) as e:
                log.warning("%s: cannot read max-deliveries notices now: %r", self.service, e)
                return
            for notice in notices:
                await self._handle(notice)

    async def _handle(self, notice: Msg) -> None:
        try:
            event = json.loads(notice.data)
            seq, deliveries = int(event["stream_seq"]), int(event.get("deliveries", 0))
        except (ValueError, KeyError, TypeError) as e:
            log.error("%s: unreadable max-deliveries notice %r: %s", self.service, notice.data, e)
            await notice.term()
            return
        subject, payload = await self._stored(seq)
        try:
            await self.dead_letter(subject, payload, deliveries, seq)
        except JetStreamMissing:
            raise  # the DLQ stream is gone: the service stops
        except Exception as e:  # noqa: BLE001 (NATS away: the notice comes back after ack_wait)
            log.error("%s: could not dead-letter seq %d after max deliveries: %r",
                      self.service, seq, e)  # fmt: skip
            await notice.nak(delay=5.0)
            return
        await notice.ack()

    async def _stored(self, seq: int) -> tuple[str, bytes]:
        """The parked message's subject and bytes; empty if the stream no longer holds it."""
        from nats.js.errors import NotFoundError

        try:
            stored = await self.js.get_msg(self.consumer.stream, seq)
        except NotFoundError as e:
            missing = not_found_missing(e, self.consumer.stream, f"reading seq {seq}")
            if missing is not None:
                raise missing from e
            log.warning("%s: seq %d of %s is gone; dead-lettering its notice without it",
                        self.service, seq, self.consumer.stream)  # fmt: skip
            return self.consumer.filter_subject, b""
        return stored.subject or self.consumer.filter_subject, stored.data or b""

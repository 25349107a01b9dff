"""The loop itself: fetch → decode → handle → act on `decide()`'s verdict.

Long handlers (a generation, an optimizer step) would exceed the consumer's
ack wait and be redelivered to another worker while still running; so while
a handler runs, the loop sends an in-progress ack every `heartbeat_s`
(default `ack_wait / 3`; heartbeats.py says why one timer per loop), and
the handler can send one itself via `Delivery.in_progress()`.
`handler_timeout_s` bounds a hung handler (it counts as a retryable
failure). A message the server stops redelivering without our verdict (the
worker crashed or hung on it every time) is dead-lettered from JetStream's
max-deliveries advisory, kept in the run's ADVISORIES stream so that one
sent while the service was down is not lost (maxdeliver.py), when the loop
is given the connection (`nc=`).

A stream or consumer that is gone (a fetch, or a handler's publish, that
nothing answers, confirmed by the server: services/runtime/missing.py) ends
the loop with `JetStreamMissing`, which stops the service; the message in
hand is handed back (nak) first.

Acks are fire-and-forget publishes (as nats-py's `ack()`): a lost ack means
one redelivery, which the deterministic message ids make harmless.

Per-message cost matters (a buffer consumes thousands of samples a second):
the success path allocates nothing it can avoid — the ack decision is a
constant, `Delivery` parses the JetStream metadata (reply subject, ~3 µs)
and copies the headers only when asked, labelled metrics are resolved once,
and heartbeats come from one timer per loop rather than one per message.
bench/wire.py measures the loop against raw nats-py consumption.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from typing import TYPE_CHECKING, Generic

from proto.codec import decode
from proto.errors import ProtocolError
from services.runtime.errors import JetStreamMissing, PermanentError, RetryableError
from services.runtime.missing import no_answer_errors, raise_if_missing
from services.runtime.msgloop.deadletter import DeadLetterPublisher, stored_origin
from services.runtime.msgloop.delivery import Delivery, Handler, M
from services.runtime.msgloop.heartbeats import Heartbeats
from services.runtime.msgloop.maxdeliver import MaxDeliveries
from services.runtime.msgloop.metrics import LoopMetrics
from services.runtime.msgloop.policy import (
    ACK,
    DEFAULT_RETRY,
    Action,
    Decision,
    RetryPolicy,
    decide,
)
from services.runtime.msgloop.wait import pause
from services.runtime.transient import transient_errors

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from prometheus_client import CollectorRegistry, Counter

    from proto.streams import ConsumerSpec

log = logging.getLogger(__name__)


class MessageLoop(Generic[M]):
    """Consume `consumer` (a durable pull consumer that must exist) into `handler`.

    `concurrency` > 1 runs up to that many handlers at once (rollout workers
    generating for several tasks); 1 keeps the stream order (the trainer).
    """

    def __init__(
        self,
        js: JetStreamContext,
        consumer: ConsumerSpec,
        message_type: type[M],
        handler: Handler[M],
        *,
        run: str,
        service: str,
        registry: CollectorRegistry,
        max_payload: int,
        batch: int = 10,
        concurrency: int = 1,
        fetch_timeout_s: float = 1.0,
        heartbeat_s: float | None = None,
        handler_timeout_s: float | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        nc: Client | None = None,
    ) -> None:
        self.js = js
        self.nc = nc  # given: also dead-letter what the server gives up on (advisories)
        self.consumer = consumer
        self.message_type = message_type
        self.handler = handler
        self.service = service
        self.metrics = LoopMetrics.for_registry(registry)
        self.dead_letters = DeadLetterPublisher(
            js,
            run=run,
            service=service,
            max_payload=max_payload,
            registry=registry,
            subject=consumer.filter_subject,
        )
        self.batch = batch
        self.concurrency = concurrency
        self.fetch_timeout_s = fetch_timeout_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else consumer.ack_wait_s / 3
        if 1.5 * self.heartbeat_s >= consumer.ack_wait_s:  # beats come up to 1.5 × apart
            raise ValueError(
                f"heartbeat_s {self.heartbeat_s} must be under 2/3 of the consumer's "
                f"ack_wait_s {consumer.ack_wait_s}, or a long handler's message is redelivered"
            )
        self.handler_timeout_s = handler_timeout_s
        self.retry = retry
        self._labels = {"service": service, "subject": consumer.filter_subject}
        # Labelled children resolved once: .labels() costs a lock and a dict
        # lookup, measurable at tens of thousands of messages per second.
        self._handled = self.metrics.handled.labels(**self._labels)
        self._transient = transient_errors()
        self._latency = self.metrics.latency.labels(**self._labels)
        self._failed: dict[str, Counter] = {}  # reason → child
        self._beats = Heartbeats(self.heartbeat_s, self.service) if self.heartbeat_s > 0 else None
        self._missing: JetStreamMissing | None = None  # set by a handler: the loop ends with it

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and handle until `stop` is set; then finish what is in flight."""
        sub = await self.js.pull_subscribe_bind(
            durable=self.consumer.durable, stream=self.consumer.stream
        )
        watcher = self._watch_max_deliveries(self.nc, stop) if self.nc is not None else None
        inflight: set[asyncio.Task[Decision]] = set()
        log.info("%s: consuming %s/%s", self.service, self.consumer.stream, self.consumer.durable)
        try:
            while not stop.is_set() and self._missing is None:
                if watcher is not None and watcher.done():
                    watcher.result()  # its JetStreamMissing (or a bug) ends the loop
                # Sequential mode handles a whole batch in order; concurrent
                # mode fetches only as many as it has free handler slots, so
                # messages never wait (and age towards ack_wait) in our hands.
                room = self.batch if self.concurrency == 1 else self.concurrency - len(inflight)
                if room <= 0:
                    await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                msgs = await self._fetch(sub, min(self.batch, room), stop)
                if msgs:
                    await self._dispatch(msgs, inflight, stop)
        finally:
            if inflight:
                await asyncio.wait(inflight)
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if self._beats is not None:
                self._beats.close()
        if self._missing is not None:
            raise self._missing

    async def _fetch(
        self, sub: JetStreamContext.PullSubscription, n: int, stop: asyncio.Event
    ) -> list[Msg]:
        """Up to `n` messages; none when there are none now or NATS is away (then retried)."""
        from nats.errors import ConnectionClosedError
        from nats.errors import TimeoutError as NatsTimeoutError

        try:
            return await sub.fetch(n, timeout=self.fetch_timeout_s)
        except (TimeoutError, NatsTimeoutError):
            return []  # nothing to do right now
        except ConnectionClosedError:
            # Closed is final (reconnecting is not): nothing more will come.
            log.error("%s: NATS connection closed; message loop ends", self.service)
            stop.set()
            return []
        except Exception as e:  # noqa: BLE001 (NATS down/reconnecting: keep trying)
            if isinstance(e, no_answer_errors()):  # or the stream/consumer is gone: stop
                c = self.consumer
                await raise_if_missing(
                    self.js, c.stream, f"fetching from {c.durable}", consumer=c.durable
                )
            log.warning("%s: fetch failed (%s: %s)", self.service, type(e).__name__, e)
            await pause(stop, 1.0)
            return []

    async def _dispatch(
        self, msgs: list[Msg], inflight: set[asyncio.Task[Decision]], stop: asyncio.Event
    ) -> None:
        for i, msg in enumerate(msgs):
            if stop.is_set() or self._missing is not None:
                # Shutting down: hand the rest back at once rather than after ack_wait.
                for rest in msgs[i:]:
                    with contextlib.suppress(Exception):  # else redelivered after ack_wait
                        await rest.nak()
                return
            if self.concurrency == 1:
                await self.process(msg)
            else:
                task = asyncio.create_task(self.process(msg))
                inflight.add(task)
                task.add_done_callback(inflight.discard)

    async def process(self, msg: Msg) -> Decision:
        """Decode, handle, and act on one message. Never raises (except cancellation).

        The success path (decode, handler, ack) is written out here rather
        than through helper coroutines: each extra coroutine frame costs
        ~0.5 µs per message, and this runs for every message a service sees.
        """
        delivery = Delivery(msg)
        error: BaseException | None = None
        beats = self._beats
        started = time.perf_counter()
        try:
            message = decode(msg.data, self.message_type)
            if beats is not None:
                beats.add(delivery, started)
            try:
                if self.handler_timeout_s is None:
                    await self.handler(message, delivery)
                else:
                    await self._handle_with_timeout(message, delivery, self.handler_timeout_s)
            finally:
                if beats is not None:
                    beats.discard(delivery)
        except (ProtocolError, PermanentError, RetryableError) as e:
            error = e
        except JetStreamMissing as e:  # not the message's fault: hand it back, stop the loop
            self._missing = e
            with contextlib.suppress(Exception):
                await msg.nak()
            return Decision(Action.NAK, error=str(e))
        except Exception as e:  # noqa: BLE001 (a bug in a handler must not stop the service)
            error = e
            log.error(
                "%s: handler failed on %s seq %d:\n%s",
                self.service,
                msg.subject,
                delivery.stream_seq,
                "".join(traceback.format_exception(e)),
            )
        finally:
            self._latency.observe(time.perf_counter() - started)
        decision = (
            ACK
            if error is None
            else decide(
                error, delivery.delivered, self.consumer.max_deliver, self.retry, self._transient
            )
        )
        try:
            if decision is ACK:
                await msg.ack()
                self._handled.inc()
            else:
                await self._act(decision, msg, delivery)
        except Exception as e:  # noqa: BLE001 (NATS gone mid-ack: the server redelivers)
            log.error(
                "%s: could not %s %s seq %d (%s: %s); it will be redelivered after ack_wait",
                self.service,
                decision.action,
                msg.subject,
                delivery.stream_seq,
                type(e).__name__,
                e,
            )
        return decision

    async def _handle_with_timeout(self, message: M, delivery: Delivery, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.handler(message, delivery), timeout_s)
        except TimeoutError as e:
            raise RetryableError(f"handler did not finish within {timeout_s}s") from e

    async def _act(self, decision: Decision, msg: Msg, delivery: Delivery) -> None:
        if decision.action is Action.ACK:
            await msg.ack()
            self._handled.inc()
            return
        self._count_failure(decision.reason or "retryable")
        if decision.action is Action.NAK:
            log.info(
                "%s: retrying %s seq %d in %.1fs (delivery %d): %s",
                self.service,
                msg.subject,
                delivery.stream_seq,
                decision.delay_s,
                delivery.delivered,
                decision.error,
            )
            await msg.nak(delay=decision.delay_s)
            return
        try:
            await self._dead_letter(
                decision, msg.subject, msg.data, delivery.delivered, delivery.stream_seq
            )
        except JetStreamMissing as e:
            self._missing = e
            await msg.nak()
            return
        except Exception as e:  # noqa: BLE001 (keep the message rather than lose it)
            log.error(
                "%s: dead-letter publish failed (%s); message seq %d will be redelivered",
                self.service,
                e,
                delivery.stream_seq,
            )
            await msg.nak(delay=self.retry.delay(delivery.delivered))
            return
        await msg.term()

    def _count_failure(self, reason: str) -> None:
        child = self._failed.get(reason)
        if child is None:
            child = self._failed[reason] = self.metrics.failed.labels(**self._labels, reason=reason)
        child.inc()

    async def _dead_letter(
        self, decision: Decision, subject: str, payload: bytes, delivered: int, seq: int
    ) -> None:
        stream = self.consumer.stream
        await self.dead_letters.publish(
            reason=decision.reason,
            error=decision.error,
            subject=subject,
            payload=payload,
            delivered=delivered,
            origin=stored_origin(stream, self.consumer.durable, seq),
            where=f"stream {stream} seq {seq}",
            expected=decision.expected,
        )

    def _watch_max_deliveries(self, nc: Client, stop: asyncio.Event) -> asyncio.Task[None]:
        """Dead-letter what the server gave up on without our verdict (maxdeliver.py)."""

        async def dead_letter(subject: str, payload: bytes, deliveries: int, seq: int) -> None:
            why = Decision(
                Action.DEAD_LETTER,
                reason="max_deliver",
                error=f"not acknowledged after {deliveries} deliveries "
                "(handler crashed, hung or timed out each time)",
            )
            await self._dead_letter(why, subject, payload, deliveries, seq)

        watcher = MaxDeliveries(self.js, nc, self.consumer, dead_letter, self.service)
        return asyncio.create_task(watcher.run(stop), name=f"{self.service}-maxdeliver")

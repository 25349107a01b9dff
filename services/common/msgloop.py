"""The message loop every service runs on a JetStream durable pull consumer.

fetch a batch → decode each message into the expected proto type → call the
service's handler → act on the outcome:

| outcome                                   | action                                   |
|-------------------------------------------|------------------------------------------|
| handler returned                          | ack                                      |
| `RetryableError`, NATS/timeout errors     | nak with a delay (backoff by delivery #) |
| the same on the last delivery             | dead-letter `max_deliver`, term          |
| `ProtocolError` (bad bytes, wrong schema) | dead-letter `<its reason>`, term         |
| `PermanentError`                          | dead-letter `<its reason>`, term         |
| any other exception (a bug)               | log traceback, dead-letter `handler_error`, term |

The table is the pure function `decide()`, tested without a server; the
loop only carries out its decisions. Errors are caught here, once per
message, so one bad message never stops a service: it goes to
`flywheel.<run>.dlq.<reason>` with `Flywheel-Dlq-Reason` / `Flywheel-Dlq-Error`
headers and a `DeadLetter` body that keeps the original bytes, and the loop
goes on. If the dead-letter publish itself fails (NATS down), the message is
nak'ed instead of terminated, so it is never dropped silently.

Long handlers (a generation, an optimizer step) would exceed the consumer's
ack wait and be redelivered to another worker while still running; so while
a handler runs, the loop sends an in-progress ack every `heartbeat_s`
(default `ack_wait / 3`; one timer per loop checks every `heartbeat_s / 2`,
so beats are `heartbeat_s` to `1.5 · heartbeat_s` apart), and the handler
can send one itself via `Delivery.in_progress()`. `handler_timeout_s`
bounds a hung handler (it counts as a retryable failure). A message the
server stops redelivering without our verdict (the worker crashed or hung
on it every time) is dead-lettered from JetStream's max-deliveries
advisory when the loop is given the connection (`nc=`).

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
import functools
import json
import logging
import time
import traceback
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Generic, TypeVar

from proto.codec import decode, encode, peek_type
from proto.errors import ProtocolError
from proto.messages import DeadLetter, Message
from proto.subjects import Subjects
from services.common.errors import PermanentError, RetryableError

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext
    from prometheus_client import CollectorRegistry, Counter

    from proto.streams import ConsumerSpec

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

REASON_HEADER = "Flywheel-Dlq-Reason"
ERROR_HEADER = "Flywheel-Dlq-Error"
MAX_HEADER_ERROR = 512  # header values are single-line and should stay small


# --- the pure policy ------------------------------------------------------


class Action(StrEnum):
    ACK = "ack"
    NAK = "nak"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class Decision:
    action: Action
    delay_s: float = 0.0  # NAK: redeliver after this long
    reason: str = ""  # DEAD_LETTER: dlq subject suffix
    error: str = ""  # what went wrong, for the header/body and the log
    expected: bool = False  # DEAD_LETTER by design (PermanentError.expected): log at DEBUG


ACK = Decision(Action.ACK)
"""The success decision; a shared constant (frozen), not one allocation per message."""


@dataclass(frozen=True)
class RetryPolicy:
    """Nak delay = base·2^(delivered-1), capped: 1, 2, 4, … 60 s by default.

    Exponential so a downstream outage is not hammered by every worker at
    once; capped so a recovered dependency is noticed within a minute.
    """

    base_s: float = 1.0
    cap_s: float = 60.0

    def delay(self, delivered: int) -> float:
        return min(self.cap_s, self.base_s * 2.0 ** (max(delivered, 1) - 1))


TRANSIENT: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)
"""Errors of the transport, not of the message: treated like RetryableError.

The message loop adds nats-py's connection errors at run time (so this
module does not import nats); a handler whose publish hits a NATS restart
gets its message redelivered, not dead-lettered as a bug.
"""


def decide(
    error: BaseException | None,
    delivered: int,
    max_deliver: int,
    policy: RetryPolicy = RetryPolicy(),
    transient: tuple[type[BaseException], ...] = TRANSIENT,
) -> Decision:
    """What to do with a message after its handler ran.

    `delivered` is JetStream's delivery count (1 on first delivery);
    `max_deliver` the consumer's limit (<= 0: unlimited). On the last
    delivery a transient failure becomes a dead letter (a poison message):
    the server would never deliver it again, and nothing may vanish silently.
    """
    if error is None:
        return ACK
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, ProtocolError):
        return Decision(Action.DEAD_LETTER, reason=error.reason, error=text)
    if isinstance(error, PermanentError):
        return Decision(
            Action.DEAD_LETTER, reason=error.reason, error=text, expected=error.expected
        )
    if isinstance(error, (RetryableError, *transient)):
        if 0 < max_deliver <= delivered:
            return Decision(
                Action.DEAD_LETTER,
                reason="max_deliver",
                error=f"gave up after {delivered} deliveries; last error {text}",
            )
        override = error.delay_s if isinstance(error, RetryableError) else None
        delay = override if override is not None else policy.delay(delivered)
        return Decision(Action.NAK, delay_s=delay, error=text)
    return Decision(Action.DEAD_LETTER, reason="handler_error", error=text)


def header_safe(text: str, limit: int = MAX_HEADER_ERROR) -> str:
    """One line, bounded: NATS headers cannot carry CR/LF."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def dead_letter(
    *,
    run: str,
    reason: str,
    error: str,
    subject: str,
    payload: bytes,
    service: str,
    delivered: int,
    max_payload: int,
    where: str = "",
) -> tuple[DeadLetter, bytes]:
    """Build and encode a DeadLetter that fits in `max_payload`.

    The original bytes travel unchanged unless they would not fit (a message
    near max_payload plus the envelope); then they are cut and the error
    says so and where the original lies (`where`: stream and sequence).
    """
    dl = DeadLetter(
        run=run,
        reason=reason,
        error=error,
        subject=subject,
        message_type=peek_type(payload),
        payload=payload,
        service=service,
        delivered=delivered,
        at=time.time(),
    )
    data = encode(dl, max_payload=None)
    if len(data) <= max_payload:
        return dl, data
    room = max_payload - (len(data) - len(payload)) - 256  # 256: the longer error text
    note = f" [payload truncated from {len(payload)} B to {room} B; original at {where or '?'}]"
    dl = dl.model_copy(update={"payload": payload[: max(room, 0)], "error": error + note})
    return dl, encode(dl, max_payload=max_payload)


# --- metrics --------------------------------------------------------------


class LoopMetrics:
    """The loop's Prometheus metrics, once per registry (every loop of a service shares them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Histogram

        labels = ("service", "subject")
        self.handled = Counter(
            "flywheel_messages_handled",
            "Messages handled successfully (acked).",
            labels,
            registry=registry,
        )
        self.failed = Counter(
            "flywheel_messages_failed",
            "Handler failures, by outcome reason (retryable failures are nak'ed).",
            (*labels, "reason"),
            registry=registry,
        )
        self.dead_lettered = Counter(
            "flywheel_messages_dead_lettered",
            "Messages sent to the dead-letter subject, by reason.",
            (*labels, "reason"),
            registry=registry,
        )
        self.latency = Histogram(
            "flywheel_handler_seconds",
            "Handler wall time per message.",
            labels,
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900),
        )

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> LoopMetrics:
        found = _METRICS.get(registry)
        if found is None:
            found = _METRICS[registry] = cls(registry)
        return found


# Prometheus refuses to register a metric name twice in one registry, so the
# loops of one service share one LoopMetrics; weak keys let a test's
# registries be collected.
_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, LoopMetrics] = weakref.WeakKeyDictionary()


# --- the loop -------------------------------------------------------------


class Delivery:
    """What a handler may know about the message beyond its body.

    Read lazily from the nats-py message: parsing the JetStream metadata out
    of the reply subject costs ~3 µs, a tenth of the loop's per-message
    budget, and most handlers never look at it.
    """

    __slots__ = ("_headers", "msg")

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        self._headers: dict[str, str] | None = None

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def headers(self) -> dict[str, str]:
        """A copy of the message headers (a handler may change it freely)."""
        if self._headers is None:
            self._headers = dict(self.msg.headers or {})
        return self._headers

    @property
    def delivered(self) -> int:
        """JetStream's delivery count: 1 on the first delivery."""
        return int(self.msg.metadata.num_delivered)

    @property
    def stream_seq(self) -> int:
        return int(self.msg.metadata.sequence.stream)

    def __repr__(self) -> str:
        return (
            f"Delivery(subject={self.subject!r}, delivered={self.delivered}, "
            f"stream_seq={self.stream_seq})"
        )

    async def in_progress(self) -> None:
        """Tell JetStream the message is still being worked on (resets its ack wait)."""
        await self.msg.in_progress()


Handler = Callable[[M, Delivery], Awaitable[None]]


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
        retry: RetryPolicy = RetryPolicy(),
        nc: Client | None = None,
    ) -> None:
        self.js = js
        self.nc = nc  # given: also dead-letter what the server gives up on (advisories)
        self.consumer = consumer
        self.message_type = message_type
        self.handler = handler
        self.run_name = run
        self.subjects = Subjects(run)
        self.service = service
        self.metrics = LoopMetrics.for_registry(registry)
        self.max_payload = max_payload
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
        self._children: dict[tuple[int, str], Counter] = {}  # (metric id, reason) → child
        self._beats = _Heartbeats(self.heartbeat_s, self.service) if self.heartbeat_s > 0 else None

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and handle until `stop` is set; then finish what is in flight."""
        from nats.errors import ConnectionClosedError
        from nats.errors import TimeoutError as NatsTimeoutError

        sub = await self.js.pull_subscribe_bind(
            durable=self.consumer.durable, stream=self.consumer.stream
        )
        watcher = await self._watch_max_deliveries(self.nc) if self.nc is not None else None
        inflight: set[asyncio.Task[Decision]] = set()
        log.info("%s: consuming %s/%s", self.service, self.consumer.stream, self.consumer.durable)
        try:
            while not stop.is_set():
                # Sequential mode handles a whole batch in order; concurrent
                # mode fetches only as many as it has free handler slots, so
                # messages never wait (and age towards ack_wait) in our hands.
                room = self.batch if self.concurrency == 1 else self.concurrency - len(inflight)
                if room <= 0:
                    await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    msgs = await sub.fetch(min(self.batch, room), timeout=self.fetch_timeout_s)
                except (TimeoutError, NatsTimeoutError):
                    continue  # nothing to do right now
                except ConnectionClosedError:
                    # Closed is final (reconnecting is not): nothing more will come.
                    log.error("%s: NATS connection closed; message loop ends", self.service)
                    stop.set()
                    break
                except Exception as e:  # noqa: BLE001 (NATS down/reconnecting: keep trying)
                    log.warning("%s: fetch failed (%s: %s)", self.service, type(e).__name__, e)
                    await _sleep_or_stop(stop, 1.0)
                    continue
                await self._dispatch(msgs, inflight, stop)
        finally:
            if inflight:
                await asyncio.wait(inflight)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.unsubscribe()
            if self._beats is not None:
                self._beats.close()

    async def _dispatch(
        self, msgs: list[Msg], inflight: set[asyncio.Task[Decision]], stop: asyncio.Event
    ) -> None:
        for i, msg in enumerate(msgs):
            if stop.is_set():
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

    def _by_reason(self, metric: Counter, reason: str) -> Counter:
        """`metric`'s child for this loop's labels and `reason`, resolved once."""
        key = (id(metric), reason)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, reason=reason)
        return child

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
        self._by_reason(self.metrics.failed, decision.reason or "retryable").inc()
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
            await self._publish_dead_letter(decision, msg, delivery)
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

    async def _publish_dead_letter(self, decision: Decision, msg: Msg, delivery: Delivery) -> None:
        meta = msg.metadata
        await self._publish_dl(
            reason=decision.reason,
            error=decision.error,
            subject=msg.subject,
            payload=msg.data,
            delivered=delivery.delivered,
            stream=meta.stream,
            seq=meta.sequence.stream,
            expected=decision.expected,
        )

    async def _publish_dl(
        self,
        *,
        reason: str,
        error: str,
        subject: str,
        payload: bytes,
        delivered: int,
        stream: str,
        seq: int,
        expected: bool = False,
    ) -> None:
        where = f"stream {stream} seq {seq}"
        _, data = dead_letter(
            run=self.run_name,
            reason=reason,
            error=error,
            subject=subject,
            payload=payload,
            service=self.service,
            delivered=delivered,
            max_payload=self.max_payload,
            where=where,
        )
        log.log(
            logging.DEBUG if expected else logging.WARNING,
            "%s: dead-lettering %s (%s) as %s: %s", self.service, subject, where, reason, error,
        )  # fmt: skip
        await self.js.publish(
            self.subjects.dlq(reason),
            data,
            headers={
                REASON_HEADER: reason,
                ERROR_HEADER: header_safe(error),
                # A crash between this publish and the term() redelivers the
                # message, and every worker of a consumer hears the same
                # max-deliveries advisory: one id keeps its dead letter stored once.
                "Nats-Msg-Id": f"dlq:{stream}:{self.consumer.durable}:{seq}",
            },
        )
        self._by_reason(self.metrics.dead_lettered, reason).inc()

    async def _watch_max_deliveries(self, nc: Client) -> Subscription:
        """Dead-letter messages the server gave up on without our verdict.

        A message whose handler crashed the process, hung past ack_wait, or
        lost its ack is redelivered until max_deliver and then silently
        parked. The server announces that on an advisory subject; we fetch
        the message by sequence and dead-letter it as `max_deliver`, so a
        poison message is visible instead of lost.
        """
        subject = (
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.consumer.stream}."
            f"{self.consumer.durable}"
        )

        async def on_advisory(advisory: Msg) -> None:
            try:
                event = json.loads(advisory.data)
                seq, deliveries = int(event["stream_seq"]), int(event.get("deliveries", 0))
                stored = await self.js.get_msg(self.consumer.stream, seq)
                await self._publish_dl(
                    reason="max_deliver",
                    error=f"not acknowledged after {deliveries} deliveries "
                    "(handler crashed, hung or timed out each time)",
                    subject=stored.subject or self.consumer.filter_subject,
                    payload=stored.data or b"",
                    delivered=deliveries,
                    stream=self.consumer.stream,
                    seq=seq,
                )
            except Exception as e:  # noqa: BLE001 (an advisory must not kill the subscription)
                log.error("%s: could not dead-letter after max deliveries: %s", self.service, e)

        return await nc.subscribe(subject, cb=on_advisory)


class _Heartbeats:
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


@functools.cache
def transient_errors() -> tuple[type[BaseException], ...]:
    """`TRANSIENT` plus nats-py's connection errors: what a publish during a NATS outage raises.

    For the message loop's verdicts, `publish`'s retries, and loops outside
    the message loop (a dispatcher, a heartbeat) that must retry such a
    publish later rather than die with it.
    """
    return TRANSIENT + _nats_transient_errors()


def _nats_transient_errors() -> tuple[type[BaseException], ...]:
    from nats import errors
    from nats.js import errors as js_errors

    return (
        errors.ConnectionClosedError,
        errors.ConnectionReconnectingError,
        errors.ConnectionDrainingError,
        errors.StaleConnectionError,
        errors.OutboundBufferLimitError,
        errors.NoRespondersError,
        js_errors.NoStreamResponseError,
        js_errors.ServiceUnavailableError,
    )


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)

"""Logging and the life of a service process: start, run until told to stop, drain.

The shape follows the NATS client examples: SIGTERM/SIGINT only *set* a stop
event (no work in a signal handler); the service's coroutines watch it and
return; then the NATS connection is drained (in-flight acks and publishes
are flushed, subscriptions unsubscribed) before the process exits. A pod
being rescheduled therefore finishes or hands back its current message
instead of leaving it to the ack-wait timeout.

The health server starts *before* the NATS connect: connecting retries with
backoff for up to a minute, and Kubernetes' liveness probe must not kill the
pod meanwhile; `/readyz` says "nats: connecting" until it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from services.runtime.http_health import HealthServer, Readiness

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from prometheus_client import CollectorRegistry

    from proto.messages import Message
    from proto.streams import ConsumerSpec, StreamSpec
    from services.runtime.msgloop import Handler, MessageLoop
    from services.runtime.settings import ServiceSettings

    M = TypeVar("M", bound=Message)

log = logging.getLogger(__name__)

_HANDLER_MARK = "_flywheel_handler"


class _UtcFormatter(logging.Formatter):
    """ISO 8601 UTC with milliseconds: sortable, and the same on every pod; credentials
    redacted from the whole line, traceback included (services/runtime/redact.py)."""

    def format(self, record: logging.LogRecord) -> str:
        from services.runtime.redact import redact

        return redact(super().format(record))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        t = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{t}.{int(record.msecs):03d}Z"


def setup_logging(service: str, level: str | int = "INFO") -> None:
    """One line per record on stderr: `time service level logger: message`.

    Idempotent: a second call replaces the handler it installed (tests start
    several services in one process) and leaves other handlers alone.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_MARK, False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    name = service.replace("%", "%%")
    handler.setFormatter(_UtcFormatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # nats-py logs every reconnect attempt at ERROR through our callbacks
    # already; aiohttp's access log would be one line per Prometheus scrape.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # An exception nothing caught is printed by the interpreter, not logged: send it
    # through the handler too, so its traceback is redacted like every other line.
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("uncaught").critical("uncaught exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    logging.getLogger("uncaught").critical(
        "uncaught exception in thread %s",
        args.thread.name if args.thread else "?",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def install_signal_handlers(
    loop: asyncio.AbstractEventLoop, stop: asyncio.Event
) -> Callable[[], None]:
    """SIGTERM and SIGINT set `stop`. Returns a function that removes the handlers."""
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s; stopping", sig.name)
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)

    def remove() -> None:
        for sig in signals:
            loop.remove_signal_handler(sig)

    return remove


@dataclass
class ServiceContext:
    """What a service's body gets from the runtime."""

    service: str
    settings: ServiceSettings
    nc: Client
    js: JetStreamContext
    registry: CollectorRegistry
    readiness: Readiness
    health: HealthServer
    stop: asyncio.Event
    max_payload: int

    def message_loop(
        self, consumer: ConsumerSpec, message_type: type[M], handler: Handler[M], **options: Any
    ) -> MessageLoop[M]:
        """A MessageLoop wired to this service (options: batch, concurrency, …)."""
        from services.runtime.msgloop import MessageLoop

        return MessageLoop(
            self.js,
            consumer,
            message_type,
            handler,
            run=self.settings.run,
            service=self.service,
            registry=self.registry,
            max_payload=self.max_payload,
            nc=self.nc,
            **options,
        )

    async def consume(
        self, consumer: ConsumerSpec, message_type: type[M], handler: Handler[M], **options: Any
    ) -> None:
        """Ensure the durable consumer, then handle its messages until `stop`."""
        from services.runtime.nats_conn import ensure_consumer

        await ensure_consumer(self.js, consumer)
        await self.message_loop(consumer, message_type, handler, **options).run(self.stop)


Body = Callable[[ServiceContext], Coroutine[Any, Any, None]]


async def run_service(
    service: str,
    settings: ServiceSettings,
    body: Body,
    *,
    streams: Sequence[StreamSpec] | None = None,
    registry: CollectorRegistry | None = None,
    stop: asyncio.Event | None = None,
    grace_s: float = 10.0,
    handle_signals: bool = True,
) -> None:
    """Health server → connect → ensure streams → run `body(ctx)` until stop → drain.

    A service's `__main__` is then: load settings, `setup_logging(name,
    settings.log_level)`, `asyncio.run(run_service(name, settings, body))`.

    `streams` defaults to proto's streams for `settings.run`. `body` should
    return once `ctx.stop` is set; after `grace_s` it is cancelled. If `body`
    returns or raises on its own, the service stops too (and the error
    propagates after the cleanup).
    """
    from prometheus_client import CollectorRegistry

    registry = registry if registry is not None else CollectorRegistry()
    stop = stop if stop is not None else asyncio.Event()
    readiness = Readiness()
    readiness.set("nats", "connecting")
    readiness.set("streams", "not ensured yet")
    remove_signals = (
        install_signal_handlers(asyncio.get_running_loop(), stop) if handle_signals else None
    )
    health = HealthServer(
        registry, readiness, host=settings.metrics_host, port=settings.metrics_port, service=service
    )
    await health.start()
    log.info("%s: metrics and health on %s", service, health.url)
    try:
        async with _connected(service, settings, readiness, streams) as (nc, max_payload):
            ctx = ServiceContext(
                service=service,
                settings=settings,
                nc=nc,
                js=nc.jetstream(),
                registry=registry,
                readiness=readiness,
                health=health,
                stop=stop,
                max_payload=max_payload,
            )
            await _run_body(body, ctx, grace_s)
    finally:
        await health.stop()
        if remove_signals is not None:
            remove_signals()
        log.info("%s: stopped", service)


@contextlib.asynccontextmanager
async def _connected(
    service: str,
    settings: ServiceSettings,
    readiness: Readiness,
    streams: Sequence[StreamSpec] | None,
) -> AsyncIterator[tuple[Client, int]]:
    """Connected, with the run's streams ensured: the client and the max payload; drained
    on the way out."""
    from proto.streams import streams_for
    from services.runtime.nats_conn import connect, ensure_streams, server_max_payload

    nc = await connect(settings.nats, service)
    try:
        readiness.set("nats", None)
        readiness.check("nats", lambda: None if nc.is_connected else "disconnected")
        n = settings.nats
        specs = (
            streams
            if streams is not None
            else streams_for(
                settings.run,
                history_max_age_s=n.history_max_age_s,
                history_max_bytes=n.history_max_bytes,
            )
        )
        await ensure_streams(nc.jetstream(), specs, replicas=settings.nats.replicas)
        readiness.ok("streams")
        yield nc, server_max_payload(nc, settings.nats.max_payload)
    finally:
        readiness.set("nats", "draining")
        await _drain(nc, service)


async def _drain(nc: Client, service: str) -> None:
    """Drain (flush what we published, unsubscribe), or just close if NATS is away.

    nats-py refuses to drain a connection that is reconnecting
    (`ConnectionReconnectingError`): a SIGTERM during a NATS restart made the
    service exit with a traceback (found by tests/chaos). Nothing unacked is
    lost by closing instead: JetStream redelivers it.
    """
    from nats.errors import ConnectionClosedError, ConnectionReconnectingError

    if nc.is_closed:
        return
    try:
        await nc.drain()
    except (ConnectionReconnectingError, ConnectionClosedError) as e:
        log.warning("%s: cannot drain NATS (%s); closing", service, type(e).__name__)
        await nc.close()


async def _run_body(body: Body, ctx: ServiceContext, grace_s: float) -> None:
    task = asyncio.create_task(body(ctx), name=f"{ctx.service}-body")
    stopped = asyncio.create_task(ctx.stop.wait(), name=f"{ctx.service}-stop")
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        try:
            await asyncio.wait_for(asyncio.shield(task), grace_s)
        except TimeoutError:
            log.warning("%s: body did not stop within %.1fs; cancelling", ctx.service, grace_s)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
    ctx.stop.set()  # the body may have ended on its own: the service is done
    task.result()  # re-raise its error, if any

"""Rank 0's batch reader: TrainBatches in stream order, each exactly once.

An ephemeral pull consumer from `start_seq` (the batch after the one the
checkpoint recorded, so no batch is trained twice and none is skipped,
whatever the durable consumers' ack state). Chunked batches are
reassembled; one that does not decode is dead-lettered with its reason and
the next is read; an older step than the trainer's (a re-publish) is
skipped; a newer one means the stream skipped a step, which training must
not paper over (`BatchStreamError`).

An ephemeral consumer has one replica, whatever the stream's: on a NATS
cluster it lives on one server, and is gone with it (found by the cluster
chaos run: every fetch answered 503 for good after a kill -9). So a failed
fetch drops the consumer and the next fetch makes a new one from the
sequence after the last message read; the step check keeps that exact.
A fetch of a consumer that is gone may also just time out: after
`CHECK_AFTER` quiet fetches the reader asks whether it still exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from proto.chunking import Reassembler
from proto.codec import decode
from proto.errors import ProtocolError
from proto.messages import TrainBatch
from proto.streams import stream_name
from proto.subjects import Subjects
from services.runtime.errors import FlywheelError
from services.runtime.lifecycle import ServiceContext
from services.runtime.missing import not_found_missing
from services.runtime.msgloop import DeadLetterPublisher, pause, stored_origin, transient_errors

log = logging.getLogger(__name__)

CHECK_AFTER = 5
"""Fetches in a row that time out (1 s each) before the reader checks its consumer exists."""


class BatchStreamError(FlywheelError, RuntimeError):
    """The batch stream skips a step: training it would break the run's order."""


@dataclass(frozen=True)
class Batch:
    """One batch to train, with where it came from and how long the trainer waited."""

    wire: TrainBatch
    seq: int  # its (last) stream sequence: the step's checkpoint records it
    waited_s: float


class BatchReader:
    """TrainBatches in stream order from `start_seq`, reassembled, validated, gap-checked."""

    def __init__(self, ctx: ServiceContext, run: str, start_seq: int) -> None:
        self.ctx = ctx
        self.run = run
        self.start_seq = max(1, start_seq)  # where the next consumer starts reading
        self.subjects = Subjects(run)
        self.reassembler = Reassembler()
        self.sub: Any = None
        self.dead_letters = DeadLetterPublisher(
            ctx.js,
            run=run,
            service="trainer",
            max_payload=ctx.max_payload,
            registry=ctx.registry,
            subject=self.subjects.batches,
        )

    async def __aenter__(self) -> BatchReader:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        cfg = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.start_seq,
            ack_policy=AckPolicy.EXPLICIT,
            inactive_threshold=300.0,
            max_ack_pending=64,
        )
        from nats.js.errors import NotFoundError

        stream = stream_name(self.run, "BATCHES")
        try:
            self.sub = await self.ctx.js.pull_subscribe(
                self.subjects.batches, durable=None, stream=stream, config=cfg
            )
        except NotFoundError as e:  # the stream is gone: no batch can ever come (stop)
            missing = not_found_missing(e, stream, "reading train batches")
            if missing is None:
                raise
            raise missing from e

    async def _consumer_exists(self) -> bool:
        """False if JetStream says our consumer is gone (True when it cannot tell now)."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.errors import NotFoundError

        passing: tuple[type[BaseException], ...] = (TimeoutError, NatsTimeout, *transient_errors())
        try:
            await self.sub.consumer_info()
        except NotFoundError:
            return False
        except passing as e:
            log.info("trainer: cannot check the batch consumer now: %s: %s", type(e).__name__, e)
        return True

    async def _drop_consumer(self) -> None:
        """Unsubscribe from a consumer that may be gone (it expires by its inactive_threshold)."""
        sub, self.sub = self.sub, None
        if sub is None:
            return
        from nats.errors import Error as NatsError

        passing: tuple[type[BaseException], ...] = (NatsError, *transient_errors())
        try:
            await sub.unsubscribe()
        except passing as e:
            log.info("trainer: leaving the old batch consumer: %s: %s", type(e).__name__, e)

    async def close(self) -> None:
        """Unsubscribe (a pull subscription left open makes the connection's drain hang)."""
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None

    async def batches(
        self, next_step: Callable[[], int], stop: asyncio.Event, max_steps: int | None
    ) -> AsyncIterator[Batch]:
        """The batch of each next step, until `stop` or `max_steps` steps are trained."""
        while not stop.is_set():
            step = next_step()
            if max_steps is not None and step >= max_steps:
                log.info("trainer: reached max_steps=%d", max_steps)
                return
            started = time.perf_counter()
            got = await self.next(step, stop)
            if got is None:
                return
            yield Batch(got[0], got[1], time.perf_counter() - started)

    async def next(self, step: int, stop: asyncio.Event) -> tuple[TrainBatch, int] | None:
        """The batch for `step` and its (last) stream sequence; None once stopped."""
        from nats.errors import ConnectionClosedError
        from nats.errors import TimeoutError as NatsTimeout

        quiet = 0
        while not stop.is_set():
            try:
                if self.sub is None:
                    await self.open()  # a new consumer, from the message after the last read
                msgs = await self.sub.fetch(1, timeout=1.0)
            except (TimeoutError, NatsTimeout):
                quiet += 1
                if quiet % CHECK_AFTER == 0 and not await self._consumer_exists():
                    log.warning("trainer: batch consumer gone; reading from %d", self.start_seq)
                    await self._drop_consumer()
                continue
            except ConnectionClosedError:
                raise  # final (reconnecting is not): nothing more will come
            except transient_errors() as e:
                # NATS restarting (JetStream answers 503 while it recovers its streams),
                # or the server holding our consumer gone: retry on a new consumer.
                log.warning(
                    "trainer: fetch failed (%s: %s); reading again from seq %d",
                    type(e).__name__,
                    e,
                    self.start_seq,
                )
                await self._drop_consumer()
                await pause(stop, 1.0)
                continue
            msg = msgs[0]
            self.start_seq = msg.metadata.sequence.stream + 1
            await msg.ack()
            try:
                whole = self.reassembler.feed(msg.data)
                if whole is None:
                    continue
                batch = decode(whole, TrainBatch)
            except ProtocolError as e:
                await self._dead_letter(msg, e)
                continue
            if batch.step < step:
                log.info("trainer: skipping batch %d (already trained)", batch.step)
                continue
            if batch.step > step:
                raise BatchStreamError(f"expected batch {step}, the stream has {batch.step}")
            return batch, msg.metadata.sequence.stream
        return None

    async def _dead_letter(self, msg: Any, e: ProtocolError) -> None:
        meta = msg.metadata
        stream, seq = meta.stream, meta.sequence.stream
        await self.dead_letters.publish(
            reason=e.reason,
            error=str(e),
            subject=msg.subject,
            payload=msg.data,
            delivered=meta.num_delivered,
            origin=stored_origin(stream, "trainer", seq),
            where=f"stream {stream} seq {seq}",
        )

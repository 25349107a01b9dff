"""Rank 0's batches of a recorded run (`[trainer] replay`): `flywheel replay train`.

The same loop as a live run (loop.py, step.py: the same step code, the
same checkpoints and weight directories), with one difference in where the
batches come from: instead of waiting on the live batch subject, this
reader walks the run's BATCHES stream as it was recorded, by sequence from
the batch after the checkpoint's to the last one stored when it started,
and then ends the loop. A sequence the stream no longer has stops the
replay naming it (`RecordingTrimmed`, services/runtime/recording.py): a
replay that skipped a batch would train something else than the run did.

It decides what to train exactly as the live reader does (batches.py): a
batch that does not decode is skipped (the live trainer dead-lettered it
and went on), an older step than the trainer's is skipped (a re-publish
after a buffer restart), a newer one is a `BatchStreamError`. Nothing is
published: no dead letters, and no WeightsPublished (publishing.py), so
no engine or sync of the recorded run hears of the replay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from proto.codec import decode
from proto.errors import ProtocolError
from proto.messages import TrainBatch
from proto.streams import stream_name
from services.runtime.lifecycle import ServiceContext
from services.runtime.recording import recorded
from services.trainer.batches import Batch, BatchStreamError

log = logging.getLogger(__name__)


class RecordedBatches:
    """The recorded run's TrainBatches from `start_seq`, in stream order, then the end."""

    def __init__(self, ctx: ServiceContext, run: str, start_seq: int) -> None:
        self.ctx, self.run, self.start_seq = ctx, run, max(1, start_seq)
        self.stream = stream_name(run, "BATCHES")

    async def __aenter__(self) -> RecordedBatches:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def batches(
        self, next_step: Callable[[], int], stop: asyncio.Event, max_steps: int | None
    ) -> AsyncIterator[Batch]:
        """The batch of each next step until the recording ends, `stop`, or `max_steps`."""
        started = time.perf_counter()
        async for seq, data in recorded(self.ctx.js, self.stream, start_seq=self.start_seq):
            if stop.is_set():
                return
            step = next_step()
            if max_steps is not None and step >= max_steps:
                log.info("trainer: replay reached max_steps=%d", max_steps)
                return
            try:
                batch = decode(data, TrainBatch)
            except ProtocolError as e:
                log.warning("trainer: replay skips stream seq %d (%s), as the run did", seq, e)
                continue
            if batch.step < step:
                log.info("trainer: replay skips batch %d (already trained)", batch.step)
                continue
            if batch.step > step:
                raise BatchStreamError(f"expected batch {step}, the recording has {batch.step}")
            yield Batch(batch, seq, time.perf_counter() - started)
            started = time.perf_counter()
        log.info("trainer: replay reached the end of %s", self.stream)

"""The RL loop, as the algorithm reads: for each batch, step → publish → record.

    python -m services.trainer -c run.toml                       # one process
    torchrun --nproc_per_node=2 -m services.trainer -c run.toml  # FSDP2

Rank 0 runs this loop (all NATS I/O); every rank runs each step
(step.py). Per batch, in stream order (batches.py):

    step      every rank trains the batch (an optimizer step); when due, the
              new weights are saved (or snapshotted, to save meanwhile)
    publish   weights → <weights_root>/<run>/v000012/ (atomic, sha256
              manifest), checkpoint (with the batch's stream position),
              then the transport and WeightsPublished (publishing.py)
    record    held-out evaluation when due (the best one's weights kept: best.py),
              then the metrics row (metrics.py)

Overlap. In one process, publishing is not on the critical path: step N's
publish and record run while step N+1 trains, and step N+2 waits for them.
The order above, per step, is unchanged. Under FSDP2 the saving is a
collective and stays in the step; only the announcing overlaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from services.runtime.lifecycle import ServiceContext
from services.trainer.batches import Batch, BatchReader
from services.trainer.heldout import HeldOut, eval_line
from services.trainer.metrics import Recorder
from services.trainer.publishing import Publisher
from services.trainer.replay import RecordedBatches
from services.trainer.settings import TrainerSettings
from services.trainer.state import reconcile_rows
from services.trainer.step import StepResult, step
from services.trainer.trainer import Trainer
from services.weights.best import keep_if_best

log = logging.getLogger(__name__)


class RLLoop:
    """Rank 0's loop over the batch stream (module docstring)."""

    def __init__(self, ctx: ServiceContext, s: TrainerSettings, trainer: Trainer, seq: int):
        self.ctx, self.s, self.trainer = ctx, s, trainer
        self.reader: BatchReader | RecordedBatches = (
            RecordedBatches(ctx, s.run, seq + 1) if s.replay else BatchReader(ctx, s.run, seq + 1)
        )  # replay: the recorded run's batches (flywheel replay train), then the end
        self.recorder = Recorder(ctx.registry, s)
        self.publisher = Publisher(ctx, s, trainer, self.recorder.metrics)
        self.heldout = HeldOut(s)  # its rows load now: a missing split fails at start-up
        self.previous = Previous()

    async def run(self) -> None:
        """For each batch in stream order: step → publish → record (one step of overlap)."""
        async with self.opened():
            await self.start()
            async for batch in self.batches():
                started = time.perf_counter()
                result = await asyncio.to_thread(step, self.trainer, self.s, batch.wire, batch.seq)
                await self.previous.done()  # the previous step's publish and record
                self.recorder.timed(batch.waited_s, time.perf_counter() - started)
                self.previous.start(self.publish_and_record(batch, result))
            await self.previous.done()

    def batches(self) -> AsyncIterator[Batch]:
        return self.reader.batches(lambda: self.trainer.step, self.ctx.stop, self.s.max_steps)

    async def publish_and_record(self, batch: Batch, r: StepResult) -> None:
        """Save (from the snapshot), announce, evaluate and record step `r.step`, in that order."""
        await self.publisher.save(batch, r)
        row = self.recorder.row(batch.wire, r, batch.waited_s)
        if r.published is not None:
            await self.publisher.announce(r.step, r.published, r.sha256, r.size_bytes)
            if self.s.eval_every and r.step % self.s.eval_every == 0:
                await self.evaluate(r.published, row)
                await asyncio.to_thread(
                    keep_if_best, self.s.checkpoint_dir, r.published, r.step, row["eval_accuracy"]
                )
        self.recorder.write(row)  # last: a row means its step is checkpointed
        self.recorder.log_step(row, r, batch.waited_s)

    async def start(self) -> None:
        """Announce what a crash left unannounced, evaluate the initial policy, say ready."""
        await self.publisher.announce_pending()
        if self.s.eval_every and self.trainer.step == 0:
            row: dict[str, Any] = {"step": 0, "time": time.time(), "elapsed": 0.0}
            await self.evaluate(self.s.model, row)
            self.recorder.write(row)
            log.info("trainer: held-out evaluation at start:%s", eval_line(row))
        self.ctx.readiness.ok("trainer")

    async def evaluate(self, path: Path, row: dict[str, Any]) -> None:
        """The held-out evaluation of the weights at `path`, into `row` and the gauges."""
        self.recorder.evaluated(await self.heldout.run(path), row)

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """The metrics file made to agree with the checkpoint; reader, evaluator, loggers open."""
        reconcile_rows(self.s.metrics_file, self.s.checkpoint_dir)
        try:
            async with self.reader, self.heldout:
                try:
                    yield
                finally:
                    await self.previous.done()
        finally:
            self.recorder.close()


class Previous:
    """The one step whose publishing may still run beside the next step's compute."""

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None

    def start(self, work: Coroutine[Any, Any, None]) -> None:
        assert self.task is None, "a step's publishing started before the previous one ended"
        self.task = asyncio.create_task(work)

    async def done(self) -> None:
        """Wait for it, if any (its errors surface here)."""
        task, self.task = self.task, None
        if task is not None:
            await task

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
    record    the metrics row (metrics.py); when due, the held-out evaluation is
              handed to evaluating.py, which runs it beside the next steps (at most
              one in flight; its result a row of its own; the best one's weights
              kept: best.py), or, with `eval_on = "engines"`, asked of the engines
              before the version is announced (engine_evals.py: sync runs it on an
              engine held at that version and sends the result back)

Overlap. In one process, publishing is not on the critical path: step N's
publish and record run while step N+1 trains, and step N+2 waits for them.
The order above, per step, is unchanged. Under FSDP2 the saving is a
collective and stays in the step; only the announcing overlaps. Each row's
`blocked_s` is how long the loop waited, after the step's compute, for the
previous step's publish and record (evaluations do not count: they run
beside).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from services.runtime.lifecycle import ServiceContext
from services.runtime.malloc import release_free_memory
from services.trainer.batches import Batch, BatchReader
from services.trainer.engine_evals import EngineEvaluations
from services.trainer.evalbudget import EvalBudget
from services.trainer.evaluating import Evaluations
from services.trainer.heldout import HeldOut
from services.trainer.lending import ThreadLending
from services.trainer.metrics import Recorder
from services.trainer.publishing import Publisher
from services.trainer.replay import RecordedBatches
from services.trainer.settings import TrainerSettings
from services.trainer.state import reconcile_rows
from services.trainer.step import StepResult, step
from services.trainer.trainer import Trainer

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
        self.heldout.loaded_models = self.recorder.metrics.eval_models_loaded
        # due evaluations deferred while over eval_max_share, until the figure is too old
        budget = EvalBudget(s.eval_max_share, s.eval_max_age_s)
        self.evals: Evaluations | EngineEvaluations
        if s.eval_on == "engines":  # sync runs them on the engines; results come back here
            self.evals = EngineEvaluations(ctx, self.recorder, s.checkpoint_dir, self.step_now,
                                           budget, s.eval_result_timeout_s)  # fmt: skip
        else:  # a model copy here, generating on a thread beside the steps
            self.evals = Evaluations(
                self.heldout, self.recorder, s.checkpoint_dir, self.step_now, budget
            )
        self.previous = Previous()
        # [trainer.cores] (flywheel up's colocated placement): cores lent to the engines
        # while a batch is awaited, borrowed while they are idle (lending.py)
        self.lending = ThreadLending.of(s.cores, trainer)

    def step_now(self) -> int:
        return self.trainer.step

    async def run(self) -> None:
        """For each batch in stream order: step → publish → record (one step of overlap)."""
        async with self.opened():
            await self.start()
            async for batch in self.batches():
                started = time.perf_counter()
                if self.lending is not None:
                    self.lending.working()
                result = await asyncio.to_thread(step, self.trainer, self.s, batch.wire, batch.seq)
                if self.lending is not None:
                    self.lending.waiting()
                computed = time.perf_counter()
                await self.previous.done()  # the previous step's publish and record
                unblocked = time.perf_counter()
                release_free_memory()  # its snapshot and this step's activations: freed pages back
                done = time.perf_counter()
                result.metrics["blocked_s"] = unblocked - computed
                result.metrics["trim_s"] = done - unblocked  # work, not waiting: not in blocked_s
                self.evals.stepped(done)  # what evaluations cost the steps, measured
                self.recorder.timed(batch.waited_s, done - started, unblocked - computed)
                self.previous.start(self.publish_and_record(batch, result))
            await self.previous.done()
            # A run that ended by itself (max_steps) gets its last due evaluation; one told
            # to stop finishes only the evaluation in flight.
            await self.evals.close(finish_pending=not self.ctx.stop.is_set())

    def batches(self) -> AsyncIterator[Batch]:
        return self.reader.batches(lambda: self.trainer.step, self.ctx.stop, self.s.max_steps)

    async def publish_and_record(self, batch: Batch, r: StepResult) -> None:
        """Save (from the snapshot), announce, evaluate and record step `r.step`, in that order."""
        await self.publisher.save(batch, r)
        row = self.recorder.row(batch.wire, r, batch.waited_s)
        if r.published is not None:
            due = bool(self.s.eval_every) and r.step % self.s.eval_every == 0
            last = self.s.max_steps is not None and r.step >= self.s.max_steps
            engines = self.s.eval_on == "engines"
            if due and engines:  # asked before announced: sync can hold an engine on it
                await self.evals.submit(r.step, r.published, row["elapsed"], last=last)
            await self.publisher.announce(r.step, r.published, r.sha256, r.size_bytes)
            if due and not engines:
                await self.evals.submit(r.step, r.published, row["elapsed"], last=last)
        self.recorder.write(row)  # last: a row means its step is checkpointed
        self.recorder.log_step(row, r, batch.waited_s)

    async def start(self) -> None:
        """Announce what a crash left unannounced, start evaluating the initial policy (it
        runs beside, as every evaluation does), say ready."""
        await self.publisher.announce_pending()
        if self.s.eval_every and self.trainer.step == 0:
            await self.evals.submit(0, self.s.model, 0.0)
        self.ctx.readiness.ok("trainer")

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """The metrics file made to agree with the checkpoint; reader, evaluator, loggers open."""
        reconcile_rows(self.s.metrics_file, self.s.checkpoint_dir)
        try:
            async with self.reader, self.heldout:
                if isinstance(self.evals, EngineEvaluations) and self.heldout.enabled:
                    await self.evals.open()
                try:
                    yield
                except BaseException:
                    self.evals.cancel()  # the run failed: do not wait for an evaluation
                    raise
                finally:
                    await self.previous.done()
                    if isinstance(self.evals, EngineEvaluations):
                        await self.evals.close_results()
        finally:
            self.recorder.close()
            if self.lending is not None:
                self.lending.close()


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

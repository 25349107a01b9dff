"""Held-out evaluations on the engines (`[trainer] eval_on = "engines"`): asked, then recorded.

The trainer holds no second model. When a version falls due (`eval_every`,
the initial policy at step 0, and the run's last step), it publishes
`EvalRequest(v)` before announcing v, so sync knows before any engine loads
v and can hold one there until v is evaluated (services/sync/evaluating.py);
the `EvalResult` that comes back (`trainer-evals` consumer) is recorded as
an evaluation run here always was (evaluating.py): a row of its own in the
metrics file (`step` = v, `elapsed` = when v was trained, `eval_s` the
engine's time, `eval_known_s` from the request to the result, and
`eval_lag_steps`), the eval gauges (which `flywheel up --target-accuracy`
reads), and the best weights (`keep_if_best`, from a link copy made when v
was asked for, since sync prunes old version directories).

Several evaluations may be out at once (sync runs them one at a time, in
version order, each on its version); one it could not run on its version
comes back skipped or aborted with the reason, logged and counted in
`evals_skipped`, and no row. The cost rule is the same as in the trainer's
own path (evalbudget.py: the steps beside an evaluation in flight, measured;
a due evaluation deferred while over `eval_max_share`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from proto.messages import EvalRequest, EvalResult
from proto.streams import consumers_for
from proto.subjects import Subjects
from services.runtime.lifecycle import ServiceContext
from services.runtime.msgloop import Delivery
from services.runtime.nats_conn import ensure_consumer
from services.runtime.publish import publish
from services.tasks.engine_eval import report_of
from services.trainer.evalbudget import EvalBudget
from services.trainer.evaluating import STAGE_DIR, Due
from services.trainer.heldout import eval_line
from services.trainer.metrics import Recorder
from services.weights.best import keep_if_best, link_or_copy

log = logging.getLogger(__name__)


class EngineEvaluations:
    """The held-out evaluations the engines run for this trainer (module docstring); the same
    interface as evaluating.Evaluations, so the loop does not care which one it has."""

    def __init__(
        self,
        ctx: ServiceContext,
        recorder: Recorder,
        checkpoint_dir: Path,
        trainer_step: Any,
        budget: EvalBudget | None = None,
        result_timeout_s: float = 300.0,
    ) -> None:
        self.ctx, self.recorder = ctx, recorder
        self.run_name = ctx.settings.run
        self.subjects = Subjects(self.run_name)
        self.budget = budget or EvalBudget(None)
        self.stage = checkpoint_dir / STAGE_DIR
        self.checkpoint_dir = checkpoint_dir
        self.trainer_step = trainer_step
        self.result_timeout_s = result_timeout_s
        self.awaiting: dict[int, Due] = {}
        self.asked_at: dict[int, float] = {}
        self.changed = asyncio.Event()  # a result came in (close() waits on it)
        self.failure: BaseException | None = None
        self.skipped = 0
        self.deferred = 0
        self.results: asyncio.Task[None] | None = None
        self.stop_results = asyncio.Event()
        shutil.rmtree(self.stage, ignore_errors=True)

    async def open(self) -> None:
        """Start taking results (before the first request: none is missed)."""
        consumer = consumers_for(self.run_name)["trainer-evals"]
        await ensure_consumer(self.ctx.js, consumer)
        loop = self.ctx.message_loop(consumer, EvalResult, self.on_result)
        self.results = asyncio.create_task(loop.run(self.stop_results), name="eval-results")

    @property
    def in_flight(self) -> bool:
        return bool(self.awaiting)

    def stepped(self, at: float) -> None:
        self.budget.stepped(at)
        self.recorder.metrics.eval_cost_share.set(self.budget.share)

    async def submit(self, step: int, weights: Path, elapsed: float, last: bool = False) -> None:
        """Ask the engines to evaluate version `step` (unless over budget: deferred)."""
        self.raise_failure()
        if self.budget.defers(step, last):
            self.deferred += 1
            self.recorder.metrics.evals_deferred.inc()
            log.info("trainer: held-out evaluation of v%d deferred: %s", step, self.budget.line())
            return
        if step > 0 and not last and self.budget.over():  # it runs: the figure aged
            log.info("trainer: held-out evaluation of v%d runs: %s", step, self.budget.age_line())
        trained = step > 0  # step 0 is the user's own directory: never pruned, never "best"
        if trained:
            weights = await asyncio.to_thread(self._link_copy, weights)
        self.awaiting[step] = Due(step, weights, elapsed, owned=trained)
        self.asked_at[step] = time.time()
        self.budget.started(step)
        self.recorder.metrics.eval_in_flight.set(1)
        req = EvalRequest(run=self.run_name, version=step, requested_at=self.asked_at[step])
        await publish(self.ctx.js, self.subjects.eval_requested, req, self.ctx.max_payload)

    async def on_result(self, msg: EvalResult, _d: Delivery | None) -> None:
        due = self.awaiting.pop(msg.version, None)
        if due is None:  # asked by an earlier trainer process, or answered twice
            log.info("trainer: evaluation result of v%d not awaited here; ignored", msg.version)
            return
        asked = self.asked_at.pop(msg.version, time.time())
        try:
            if msg.outcome == "evaluated":
                await self._record(due, msg, asked)
            else:
                self.skipped += 1
                self.recorder.metrics.evals_skipped.inc()
                log.info("trainer: held-out evaluation of v%d %s on the engines: %s",
                         msg.version, msg.outcome, msg.reason)  # fmt: skip
        except OSError as e:  # a row or best weights that cannot be written: the loop raises it
            self.failure = e
        finally:
            self._discard(due)
            if not self.awaiting:
                self.budget.ended()
                self.recorder.metrics.eval_in_flight.set(0)
            self.changed.set()

    async def _record(self, due: Due, msg: EvalResult, asked: float) -> None:
        report = report_of(msg)
        row: dict[str, Any] = {
            "step": due.step,
            "time": time.time(),
            "elapsed": due.elapsed,
            "eval_s": msg.finished_at - msg.started_at,  # on the engine
            "eval_known_s": time.time() - asked,  # asked (the version trained) -> known here
            "eval_lag_steps": self.trainer_step() - due.step,
            "eval_cost_share": self.budget.share,
            "evals_deferred": self.deferred,
        }
        self.recorder.evaluated(report, row)
        if due.step > 0:
            await asyncio.to_thread(
                keep_if_best, self.checkpoint_dir, due.weights, due.step, row["eval_accuracy"]
            )
        self.recorder.write(row)
        log.info(
            "trainer: held-out evaluation of v%d on engine %s (%.1fs there, known %.1fs after "
            "asking, %d steps trained meanwhile):%s",
            due.step,
            ",".join(msg.engines),
            row["eval_s"],
            row["eval_known_s"],
            row["eval_lag_steps"],
            eval_line(row),
        )

    def raise_failure(self) -> None:
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure

    async def close(self, finish_pending: bool) -> None:
        """A run that ended by itself waits up to `result_timeout_s` for the results still
        out; one told to stop does not wait. Then the results stop being taken."""
        deadline = time.monotonic() + (self.result_timeout_s if finish_pending else 0.0)
        while self.awaiting and (left := deadline - time.monotonic()) > 0:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                break
        for step in sorted(self.awaiting):
            log.warning("trainer: held-out evaluation of v%d: no result from the engines %s",
                        step, "in time" if finish_pending else "before the stop")  # fmt: skip
        self.cancel()
        await self.close_results()
        self.raise_failure()

    def cancel(self) -> None:
        for due in self.awaiting.values():
            self._discard(due)
        self.awaiting.clear()
        self.stop_results.set()

    async def close_results(self) -> None:
        self.stop_results.set()
        if self.results is not None:
            await asyncio.gather(self.results, return_exceptions=True)
            self.results = None

    def _link_copy(self, published: Path) -> Path:
        target = self.stage / published.name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(published, target, copy_function=link_or_copy)
        return target

    def _discard(self, due: Due) -> None:
        if due.owned:
            shutil.rmtree(due.weights, ignore_errors=True)

"""Held-out evaluations beside the training loop: the trainer never waits for one.

An evaluation that is due (`eval_every`) is handed here and the loop goes
on training; it runs as an asyncio task (the model load and generation on
a thread, the scoring on the event loop, heldout.py) while later steps
train. At most one is in flight. A version that falls due while one runs
waits as the one pending evaluation; a newer one replaces it (the older is
skipped, logged and counted), so a slow evaluation never builds a queue:
the next evaluation is always of the newest due version.

What the evaluations cost the steps beside them is measured as the run goes
(evalbudget.py); while it is over `[trainer] eval_max_share` of the RL wall
time, a due evaluation is deferred: not started, logged and counted (the
step-0 evaluation and a run's last due one never are). Its rows carry the
running estimate (`eval_cost_share`).

A user watches the console, not the log: the run's first skipped and first
deferred evaluation each say there (a warning, once per kind) why it did not
run and which keys would change that; every one is logged and counted
(`evals_skipped`, `evals_deferred`), and the status line shows the counts
beside the newest figure and the version it measured.

Each result is attached to the version it evaluated: a row of its own in
the metrics file (`step` = that version, `elapsed` = when that version was
trained, `eval_s` how long the evaluation took, `eval_lag_steps` how many
steps were trained meanwhile; no `batch_id`, like the step-0 row), the
eval gauges, and the best-weights choice (`keep_if_best`: validation only,
highest accuracy, ties keep the older). The evaluations run one after the
other in version order, so the choice among the versions evaluated is the
same whatever the timing; which due versions get evaluated does depend on
timing once an evaluation outlasts `eval_every` steps.

Greedy pass@1 first. That row is written, the gauges set and the best
weights chosen as soon as the greedy generations are scored; a task with
`eval.k > 1` then draws its k samples per row (k times the generations)
and the version gets a second row with `eval_pass_at_k` and `eval_k_s`
(the whole evaluation's seconds). pass@1 is the figure a run's target and
the best weights are judged on, so a user learns it without waiting for
the samples (on the review task's file, k = 4: a fifth of the generations).
The newest figure comes first: when a newer version falls due while an
older one's samples are drawn (or a run is told to stop), those samples
are called off (their generation ends at its next token, the row is left
out, logged; the console warns once) and the newer version's pass@1
starts at once, on its own thread (`eval_greedy_nice`): the called-off
generation, at nice 19 on busy cores, can take tens of seconds to reach
its next token (measured: v10's pass@1 started 31 s after v10 was due on
the review task while v0's samples wound down). So pass@k is measured only
while the evaluations keep up; a run that ends by itself still gets its
last version's.

What the budget counts (evalbudget.py) is the greedy pass: the samples run
at `eval_nice`, below the steps' priority, and are called off by the next due
version, so while they are drawn a step's gap counts as alone. Counted as
beside before, k = 4 samples at nice 19 outlasted the ten steps to the next
due version on the review task and deferred v20's pass@1 ("an evaluation was
running beside every step so far"). Where `eval_nice` is not above
`eval_greedy_nice`, the samples count as before.

A version's directory may be pruned by sync while it is evaluated (sync
keeps only the last few): each evaluation first hard-links the directory
into `<checkpoint_dir>/.eval/` (no bytes copied on one filesystem), reads
and keeps the best from there, and removes its link copy at the end.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.tasks.evaluate import EvalReport, Halted
from services.trainer.evalbudget import EvalBudget
from services.trainer.heldout import HeldOut, eval_line
from services.trainer.metrics import Recorder
from services.weights.best import keep_if_best, link_or_copy

log = logging.getLogger(__name__)

STAGE_DIR = ".eval"
STOPPING = "the run is stopping"


@dataclass(frozen=True)
class Due:
    """One version to evaluate."""

    step: int
    weights: Path  # what is evaluated: a link copy of the published directory (step 0: the model)
    elapsed: float  # seconds of RL when that version was trained
    owned: bool  # `weights` is this module's link copy, removed after


@dataclass
class Flight:
    """The evaluation in flight: its version, and what calls its samples off."""

    due: Due
    halt: threading.Event = field(default_factory=threading.Event)  # set: generation ends
    task: asyncio.Task[None] | None = None
    sampling: bool = False  # its pass@1 row is written and it draws the pass@k samples
    why: str = ""  # why its samples were called off


class Evaluations:
    """The held-out evaluations of one run, at most one in flight (module docstring)."""

    def __init__(
        self,
        heldout: HeldOut,
        recorder: Recorder,
        checkpoint_dir: Path,
        trainer_step: Any,
        budget: EvalBudget | None = None,
    ) -> None:
        self.heldout, self.recorder = heldout, recorder
        self.budget = budget or EvalBudget(None)  # None: never deferred
        self.stage = checkpoint_dir / STAGE_DIR
        self.checkpoint_dir = checkpoint_dir
        self.trainer_step = trainer_step  # () -> the trainer's step now (for the lag)
        self.flight: Flight | None = None
        self.pending: Due | None = None
        self.failure: BaseException | None = None
        self.skipped = 0
        self.deferred = 0
        self.told: set[str] = set()  # kinds of "not run" the console was told of (once each)
        shutil.rmtree(self.stage, ignore_errors=True)  # link copies a crash left behind

    @property
    def in_flight(self) -> bool:
        return self.flight is not None

    def stepped(self, at: float) -> None:
        """A trained step ended at `at` (time.perf_counter()): the cost estimate moves on."""
        self.budget.stepped(at)
        self.recorder.metrics.eval_cost_share.set(self.budget.share)

    async def submit(self, step: int, weights: Path, elapsed: float, last: bool = False) -> None:
        """Evaluate `weights` (version `step`) now, or next if one is running (module doc),
        unless the evaluations' cost is over budget (then deferred; never at step 0 nor for
        the run's `last` step).

        Raises what a finished evaluation raised (a broken verifier stops the
        run as it did when evaluations ran in the loop).
        """
        self.raise_failure()
        trained = step > 0  # step 0 is the user's own directory: never pruned, never "best"
        if self.budget.defers(step, last):
            self._defer(step)
            return
        if step > 0 and not last and self.budget.over():  # it runs: the figure aged
            log.info("trainer: held-out evaluation of v%d runs: %s", step, self.budget.age_line())
        if trained:
            weights = await asyncio.to_thread(self._link_copy, step, weights)
        due = Due(step, weights, elapsed, owned=trained)
        if self.flight is None:
            self._start(due)
            return
        if self.pending is not None:
            self._skip(self.pending, newer=step)
        self.pending = due
        if self.flight.sampling:  # the newest version's pass@1 before an older one's pass@k
            self._give_way(self.flight)

    def raise_failure(self) -> None:
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure

    async def close(self, finish_pending: bool) -> None:
        """Wait for the evaluation in flight; then the pending one too when `finish_pending`
        (a run that ended by itself), else it is skipped (a run told to stop) and pass@k
        samples in flight are called off, not waited for."""
        if not finish_pending and self.pending is not None:
            pending, self.pending = self.pending, None
            self._skip(pending, newer=None)
        flight = self.flight
        if not finish_pending and flight is not None and flight.sampling:
            self._call_off(flight, STOPPING)
            self._detach(flight)  # its thread ends at the next token, alone
        while self.flight is not None and self.flight.task is not None:
            await asyncio.wait({self.flight.task})
            await asyncio.sleep(0)  # its done-callback runs (and may start the pending one)
        self.raise_failure()

    def cancel(self) -> None:
        """On an error in the loop: stop waiting for the evaluation (its thread ends alone)."""
        if self.pending is not None:
            self._discard(self.pending)
            self.pending = None
        if self.flight is not None and self.flight.task is not None:
            self.flight.halt.set()
            self.flight.task.cancel()

    # ---- one evaluation ------------------------------------------------------

    def _start(self, due: Due) -> None:
        self.recorder.metrics.eval_in_flight.set(1)
        self.budget.started(due.step)
        flight = Flight(due)
        flight.task = asyncio.create_task(self._run(flight), name=f"evaluate-v{due.step}")
        flight.task.add_done_callback(lambda task: self._finished(flight, task))
        self.flight = flight

    def _detach(self, flight: Flight) -> None:
        """No longer the evaluation in flight (its samples were called off): the next one
        need not wait for its generation to reach its next token, which at nice 19 on busy
        cores can take tens of seconds; it ends alone and writes nothing more."""
        if self.flight is flight:
            self.flight = None
            self.budget.ended()
            self.recorder.metrics.eval_in_flight.set(0)

    def _finished(self, flight: Flight, task: asyncio.Task[None]) -> None:
        """An evaluation ended: its failure kept for the loop to raise, or the next one on."""
        current = self.flight is flight
        self._detach(flight)
        failure = None if task.cancelled() else task.exception()
        if failure is not None:  # raised in the loop by the next submit() or close()
            log.error("trainer: held-out evaluation failed: %r", failure)
            self.failure = failure
            return
        if current and not task.cancelled() and self.pending is not None:
            due, self.pending = self.pending, None
            self._start(due)

    def _give_way(self, flight: Flight) -> None:
        """A newer version is due while `flight` draws its samples: those are called off and
        the newer version's evaluation starts now."""
        assert self.pending is not None
        self._call_off(flight, f"v{self.pending.step} is due")
        self._detach(flight)
        due, self.pending = self.pending, None
        self._start(due)

    async def _run(self, flight: Flight) -> None:
        try:
            await self._evaluate(flight)
        finally:
            self._discard(flight.due)

    async def _evaluate(self, flight: Flight) -> None:
        started, due = time.perf_counter(), flight.due

        async def pass_at_1(report: EvalReport) -> None:
            await self._pass_at_1(due, report, time.perf_counter() - started)
            flight.sampling = self.heldout.draws_samples
            if flight.sampling and self.heldout.samples_yield and self.flight is flight:
                self.budget.ended()  # what is left runs below the steps' priority (docstring)
            if flight.sampling and self.pending is not None and self.flight is flight:
                self._give_way(flight)  # fell due during the greedy pass

        try:
            report = await self.heldout.run(due.weights, pass_at_1, flight.halt)
        except Halted:
            report = None
        finally:
            flight.sampling = False
        if report is None or (flight.halt.is_set() and self.heldout.draws_samples):
            self._called_off(due.step, flight.why)
        elif report.pass_at_k is not None:
            self._pass_at_k(due, report, time.perf_counter() - started)

    def _call_off(self, flight: Flight, why: str) -> None:
        """End `flight`'s pass@k samples (their generation stops at its next token)."""
        if not flight.halt.is_set():
            flight.why = why
            flight.halt.set()

    def _called_off(self, step: int, why: str) -> None:
        line = f"held-out pass@k of v{step} called off: {why}"
        if why != STOPPING and self._first("called off"):
            log.warning(
                "trainer: %s. pass@1 of each due version comes first, its pass@k only while no "
                "newer version waits: for more pass@k figures raise [trainer] eval_every or "
                "make the samples cheaper ([task.eval] k, size, max_new_tokens)",
                line,
            )
        log.info("trainer: %s", line)

    async def _pass_at_1(self, due: Due, report: EvalReport, took: float) -> None:
        """The version's row, the gauges and the best-weights choice, as soon as greedy
        pass@1 is known (before any pass@k samples are drawn)."""
        row: dict[str, Any] = {
            "step": due.step,
            "time": time.time(),
            "elapsed": due.elapsed,
            "eval_s": took,
            "eval_lag_steps": self.trainer_step() - due.step,
            "eval_cost_share": self.budget.share,  # the running estimate (evalbudget.py)
            "evals_deferred": self.deferred,
        }
        self.recorder.evaluated(report, row)
        if due.step > 0:
            await asyncio.to_thread(
                keep_if_best, self.checkpoint_dir, due.weights, due.step, row["eval_accuracy"]
            )
        self.recorder.write(row)
        log.info(
            "trainer: held-out evaluation of v%d (%.1fs, %d steps trained meanwhile):%s",
            due.step,
            row["eval_s"],
            row["eval_lag_steps"],
            eval_line(row),
        )

    def _pass_at_k(self, due: Due, report: EvalReport, took: float) -> None:
        """The version's pass@k, a row of its own (`eval_k_s`: the whole evaluation's seconds,
        pass@1's included), written when its samples are scored."""
        row: dict[str, Any] = {
            "step": due.step,
            "time": time.time(),
            "elapsed": due.elapsed,
            "eval_k_s": took,
        }
        self.recorder.sampled(report, row)
        self.recorder.write(row)
        log.info(
            "trainer: held-out pass@%d of v%d (%.1fs in all): %.3f",
            report.k,
            due.step,
            took,
            row["eval_pass_at_k"],
        )

    # ---- the link copies ---------------------------------------------------------

    def _link_copy(self, step: int, published: Path) -> Path:
        target = self.stage / published.name
        shutil.rmtree(target, ignore_errors=True)  # a crash's leftover
        shutil.copytree(published, target, copy_function=link_or_copy)
        return target

    def _discard(self, due: Due) -> None:
        if due.owned:
            shutil.rmtree(due.weights, ignore_errors=True)

    def _defer(self, step: int) -> None:
        self.deferred += 1
        self.recorder.metrics.evals_deferred.inc()
        if self._first("deferred"):
            log.warning(
                "trainer: held-out evaluation of v%d not run (deferred): %s",
                step,
                self.budget.explain(),
            )
        log.info("trainer: held-out evaluation of v%d deferred: %s", step, self.budget.line())

    def _skip(self, due: Due, newer: int | None) -> None:
        self.skipped += 1
        self.recorder.metrics.evals_skipped.inc()
        why = f"v{newer} is newer" if newer is not None else STOPPING
        if newer is not None and self._first("skipped"):
            log.warning("trainer: %s", skipped_line(due.step, newer))
        log.info("trainer: held-out evaluation of v%d skipped: %s", due.step, why)
        self._discard(due)

    def _first(self, kind: str) -> bool:
        """Whether this is the run's first evaluation not run for `kind`: the console (a
        WARNING) is told why once; every one is in the log and counted on the status line."""
        first = kind not in self.told
        self.told.add(kind)
        return first


def skipped_line(step: int, newer: int) -> str:
    """Why a due evaluation was skipped, in a user's words (the console's one line)."""
    return (
        f"held-out evaluation of v{step} not run (skipped): v{newer} fell due while an "
        f"evaluation was still running, and only the newest due version waits for it. "
        "An evaluation takes longer than [trainer] eval_every steps: raise eval_every or make "
        "one cheaper ([task.eval] size, k, max_new_tokens); the status line counts those not run"
    )

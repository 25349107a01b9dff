"""What held-out evaluations cost the training, measured as it runs; and the rule that
defers a due evaluation while that cost is over `[trainer] eval_max_share`.

An evaluation runs beside the loop (evaluating.py), so it never stops a
step; what it costs is the CPU (or the host cores) it takes from the
steps, and the engine, beside it. That is measured the way
bench/demo_real_seeds.py's `beside_share` measures it after a run:

- a *gap* is the wall time between two consecutive trained steps' ends
  (waiting for the batch, computing it, publishing the previous one): the
  loop's wall time, step by step, from its first trained step;
- a gap during which a held-out evaluation of a trained version was in
  flight, for any part of it, is *beside*; one with none is *alone*; one
  touched only by the step-0 evaluation is neither (that evaluation runs
  once, before anything is trained, and is never deferred; `beside_share`
  leaves it out too);
- cost = sum over the beside gaps of max(0, gap - median of the last
  `WINDOW` alone gaps); unknown (0) until `MIN_ALONE` alone gaps are seen,
  and an unknown cost after `MIN_ALONE` beside gaps defers (`over`);
- share = cost / RL seconds (the sum of all gaps).

A due evaluation is deferred (not started; that version is not evaluated,
the next due one is considered again) while cost > eval_max_share x RL
seconds. Since cost <= the beside gaps' sum <= RL seconds, a share of 1.0
never defers. On a machine with spare cores an evaluation slows no step,
its cost stays ~0 and nothing is deferred; on a saturated CPU the
evaluations are spread out until their cost fits the share.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 50  # alone gaps the typical step is the median of (recent: a run's steps drift)
MIN_ALONE = 3  # alone gaps before the cost is known; fewer: a median of noise


class EvalBudget:
    """The running cost of the evaluations beside the loop (module docstring). Pure: the
    loop tells it when steps end and evaluations start and end, in seconds it measured."""

    def __init__(self, max_share: float | None, max_age_s: float | None = None) -> None:
        self.max_share = max_share
        self.max_age_s = max_age_s  # RL seconds a figure may age before one runs anyway
        self.rl_at_start = 0.0  # RL seconds when the newest evaluation started (step 0's: 0)
        self.alone: deque[float] = deque(maxlen=WINDOW)
        self.beside: list[float] = []
        self.rl_s = 0.0
        self.last_end: float | None = None
        self.running: bool | None = None  # None: none in flight; else "counted" (step > 0)
        self.touched_counted = False  # this gap saw an evaluation of a trained version
        self.touched_initial = False  # ... or the step-0 evaluation

    def started(self, step: int) -> None:
        """An evaluation of version `step` began (step 0: the initial policy's)."""
        self.running = step > 0
        self.rl_at_start = self.rl_s
        self._touch()

    def ended(self) -> None:
        self.running = None

    def stepped(self, at: float) -> None:
        """A trained step ended at `at` (a monotonic clock's seconds)."""
        if self.last_end is not None:
            gap = max(0.0, at - self.last_end)
            self.rl_s += gap
            if self.touched_counted:
                self.beside.append(gap)
            elif not self.touched_initial:
                self.alone.append(gap)
        self.last_end = at
        self.touched_counted = self.touched_initial = False
        self._touch()  # the next gap starts with the evaluation still in flight, if any

    def _touch(self) -> None:
        if self.running is True:
            self.touched_counted = True
        elif self.running is False:
            self.touched_initial = True

    @property
    def typical_s(self) -> float | None:
        """The median alone gap, None until MIN_ALONE of them."""
        return statistics.median(self.alone) if len(self.alone) >= MIN_ALONE else None

    @property
    def cost_s(self) -> float:
        typical = self.typical_s
        if typical is None:
            return 0.0
        return sum(max(0.0, g - typical) for g in self.beside)

    @property
    def share(self) -> float:
        """cost / RL seconds so far (0 before any gap)."""
        return self.cost_s / self.rl_s if self.rl_s > 0 else 0.0

    def over(self) -> bool:
        """Whether the cost is over budget now (cost > max_share x RL seconds). Unknown
        (fewer than MIN_ALONE alone gaps) after MIN_ALONE beside ones counts as over: an
        evaluation in flight at nearly every step is the costly case, and the loop must
        run alone for a few steps before a cost can be told (ticket routing, k = 4 on 150
        messages: each evaluation outlasted the 5 steps to the next one)."""
        if self.max_share is None or self.max_share >= 1.0:
            return False
        if self.typical_s is None:
            return len(self.beside) >= MIN_ALONE
        return self.cost_s > self.max_share * self.rl_s

    def defers(self, step: int, last: bool = False) -> bool:
        """Whether the evaluation of version `step`, falling due now, is deferred: over
        budget, and neither the initial policy's (step 0) nor the run's `last` step's, nor
        due when the newest evaluation started `max_age_s` RL seconds ago or more."""
        return step > 0 and not last and self.over() and not self.aged()

    def aged(self) -> bool:
        """Whether the newest evaluation started `max_age_s` or more RL seconds ago: the
        status line's figure is that old, and the next due version runs whatever it costs.
        On 2 cores a run of ticket routing trained 45 steps (6 minutes) past its last
        figure with every evaluation deferred (bench/results_learning.md, the panel)."""
        return self.max_age_s is not None and self.rl_s - self.rl_at_start >= self.max_age_s

    def age_line(self) -> str:
        """Why an evaluation over budget runs: the log's line."""
        age = self.rl_s - self.rl_at_start
        return (f"the newest evaluation started {age:.0f} s of RL ago, over [trainer] "
                f"eval_max_age_s ({self.max_age_s:g} s); {self.line()}")  # fmt: skip

    def line(self) -> str:
        """'evaluations cost 31 s of 400 s of RL (7.8%), over eval_max_share 5%', or what
        is known when no step ran alone yet (it read '0 s ... (0.0%), over' before)."""
        limit = f"{self.max_share * 100:g}%" if self.max_share is not None else "none"
        if self.typical_s is None:  # over() says so when no step has yet run alone
            return (
                f"evaluations cost unknown after {self.rl_s:.0f} s of RL: {len(self.beside)} "
                f"steps had one beside, none ran alone (eval_max_share {limit})"
            )
        return (
            f"evaluations cost {self.cost_s:.0f} s of {self.rl_s:.0f} s of RL "
            f"({self.share:.1%}), over eval_max_share {limit}"
        )

    def explain(self) -> str:
        """Why a deferred evaluation did not run, in a user's words, with what to change:
        the console's one line about deferrals (evaluating.py says it once a run)."""
        limit = f"{self.max_share * 100:g}%" if self.max_share is not None else "none"
        if self.typical_s is None:
            why = (
                f"an evaluation was running beside every step so far ({len(self.beside)} "
                f"steps, {self.rl_s:.0f} s), so what evaluations cost the training cannot be "
                f"measured yet; they wait until a few steps train alone"
            )
        else:
            why = (
                f"the evaluations have slowed the training by {self.cost_s:.0f} s of "
                f"{self.rl_s:.0f} s ({self.share:.1%}), more than [trainer] eval_max_share "
                f"({limit}) allows"
            )
        return (
            f"{why}. Later due versions are tried again; the status line counts those not "
            "run. For more evaluations: raise [trainer] eval_max_share (1.0: never defer) "
            "or make one cheaper ([task.eval] size, k, max_new_tokens)"
        )

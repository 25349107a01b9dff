"""Collapse made visible: flat groups, distinct completions, a stall said once (pure).

A policy that collapses answers every prompt alike: each group's samples are
the same token sequence (or earn the same reward), every group is flat (no
reward spread, zero advantage), the zero-variance filter drops them all and
the trainer waits for a batch that does not come. Measured on the real-model
demo (bench/results_demo_real.md, run 5): 341 groups filtered by step 28,
the trainer waiting 70-92 s a step, nothing in the console saying why.

So per step the buffer measures, over the groups it received while that
step's batch was being filled (`StepWindow`): the share of flat groups and
the mean number of distinct completions per group (distinct response token
sequences among its samples: 1 of 8 is a policy that says one thing). And
when `warn_steps` steps' worth of groups in a row brought nothing trainable
(`StallWatch`), it says so in one console line, with the cause and the keys
that help; one line per stall, not one per group.

Solved is not stuck. A group is also flat when every reply is right: at 0.89
validation on the real-model demo the console called that a collapse and
listed keys to change. So a flat group whose every scored sample reaches the
curriculum's `pass_reward` is *solved* (`is_solved`), and the stall line tells
the cases apart: every group solved says the prompts are solved (the
curriculum retires them, services/buffer/curriculum.py) and lists no keys;
only flat groups of wrong or alike replies are reported as a collapse or a
flat run, with the keys that help. When the whole training set is retired,
`all_solved_line` says so and the buffer stops the run or goes on, as
`[buffer] on_solved` says (services/buffer/app.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.messages import SampleGroup


def distinct_completions(group: SampleGroup) -> int:
    """How many different response token sequences the group's samples are."""
    return len({s.response_ids for s in group.samples})


def is_flat(group: SampleGroup) -> bool:
    """No reward spread among the group's scored samples (a verifier error is no reward)."""
    return len({s.reward for s in group.samples if s.verifier_error is None}) <= 1


def is_solved(group: SampleGroup, pass_reward: float) -> bool:
    """Every scored sample earned at least `pass_reward` (right): flat, and nothing to learn."""
    scored = [s.reward for s in group.samples if s.verifier_error is None]
    return bool(scored) and min(scored) >= pass_reward


@dataclass
class Tally:
    groups: int = 0
    flat: int = 0
    distinct: int = 0  # summed over the groups
    samples: int = 0  # summed over the groups
    solved: int = 0  # of the flat groups: every reply right (is_solved)

    def add(self, flat: bool, distinct: int, samples: int, solved: bool = False) -> None:
        self.groups += 1
        self.flat += flat
        self.distinct += distinct
        self.samples += samples
        self.solved += solved

    @property
    def flat_share(self) -> float:
        return self.flat / self.groups if self.groups else 0.0

    @property
    def distinct_mean(self) -> float:
        return self.distinct / self.groups if self.groups else 0.0

    @property
    def group_size(self) -> float:
        return self.samples / self.groups if self.groups else 0.0


@dataclass
class StepWindow:
    """The figures of the groups received while one step was being filled.

    `current` fills until the step's batch is published (`closed`), then it is
    `last`. The figures shown are last step's, or the step being filled once it
    has received a step's worth (`per_step`) of groups: a stalled step, where
    no batch closes the window, shows itself live.
    """

    per_step: int
    current: Tally = field(default_factory=Tally)
    last: Tally | None = None

    def add(self, group: SampleGroup) -> None:
        self.current.add(is_flat(group), distinct_completions(group), len(group.samples))

    def closed(self) -> None:
        self.last, self.current = self.current, Tally()

    def shown(self) -> Tally:
        if self.last is None or self.current.groups >= self.per_step:
            return self.current
        return self.last


@dataclass
class StallWatch:
    """Groups in a row that brought nothing trainable; one warning per stall.

    A group is trainable when it fills a batch slot as generated (a replayed
    group is not counted: it shows the loop is starved, not that it is fed).
    After `limit` groups in a row that were not, `stalled` returns the console
    line once; a trainable group ends the stall and re-arms it.
    """

    limit: int  # groups; 0: never warn
    pass_reward: float = 1.0  # a reply at least this is right ([buffer] curriculum_pass_reward)
    streak: Tally = field(default_factory=Tally)
    warned: bool = False

    def observe(self, group: SampleGroup, trainable: bool) -> None:
        if trainable:
            self.streak, self.warned = Tally(), False
        else:
            flat = is_flat(group)
            solved = flat and is_solved(group, self.pass_reward)
            self.streak.add(flat, distinct_completions(group), len(group.samples), solved)

    def stalled(self, per_step: int, retiring: str = "") -> str | None:
        """The stall's one console line, when it is due (else None); `retiring`: what the
        curriculum does with solved prompts (`retirement_note`), said when some are."""
        if self.warned or self.limit <= 0 or self.streak.groups < self.limit:
            return None
        self.warned = True
        return stall_line(self.streak, per_step, retiring)


KEYS_THAT_HELP = (
    "[buffer] temperature (higher samples more unlike replies), samples_per_prompt, "
    "flat_rest_steps, refill_max_share, curriculum_* (easy/hard weights, retirement); "
    "[trainer.loss] entropy_coef and the trainer's entropy-control keys (docs/learning.md)"
)


def stall_line(t: Tally, per_step: int, retiring: str = "") -> str:
    """What a stall is and why, in one line (docs/learning.md, 'Collapse made visible'):
    solved prompts, a collapse, flat groups, or the filters."""
    steps = t.groups / per_step if per_step else 0.0
    head = f"no trainable group in the last {t.groups} ({steps:.1f} steps' worth): "
    if t.groups and t.solved == t.groups:
        return head + (
            "every reply of every group earned the top reward: these prompts are solved, "
            "not stuck (no collapse; nothing is left to learn from them)"
            + (f". {retiring}" if retiring else "")
        )
    if t.flat == t.groups and t.solved == 0 and t.distinct_mean <= 1.5:
        cause = (
            f"every group flat and {t.distinct_mean:.1f} distinct completions of "
            f"{t.group_size:.0f} per group: the policy answers every prompt alike (collapse)"
        )
    elif t.flat >= t.groups / 2:
        cause = (
            f"{t.flat_share:.0%} of groups flat (no reward spread; {t.distinct_mean:.1f} distinct "
            f"completions of {t.group_size:.0f} per group): every sample of a group earns "
            "the same reward"
        )
        if t.solved:
            cause += (
                f" ({t.solved} of them solved, every reply right; the other "
                f"{t.flat - t.solved}, every reply wrong or alike)"
            )
    else:
        cause = "groups dropped by the filters or as stale (see the dead letters by reason)"
    return head + f"{cause}. Keys that help: {KEYS_THAT_HELP}"


def retirement_note(retired: int, total: int, retiring: bool, on_solved: str) -> str:
    """What becomes of solved prompts in this run, for the stall line: retired by the
    curriculum (and, when all are, the run ends or goes on), or kept (retirement off)."""
    if not retiring:
        return (
            "The curriculum does not retire solved prompts in this run ([buffer] curriculum, "
            "curriculum_retire_after): they keep being drawn"
        )
    end = "stops" if on_solved == "stop" else "goes on drawing them"
    return (
        f"The curriculum retires solved prompts ({retired} of {total} retired so far); "
        f'when all are, the run {end} ([buffer] on_solved = "{on_solved}")'
    )


def all_solved_line(total: int, pass_rate: float, after: int, on_solved: str) -> str:
    """The whole training set is solved: what the console says once, by `on_solved`."""
    head = (
        f"the whole training set is solved: every one of its {total} prompts is retired "
        f"(pass rate >= {pass_rate:g} over at least {after} groups)"
    )
    if on_solved == "stop":
        return (
            f'{head}; stopping the run ([buffer] on_solved = "stop"; "continue" goes on '
            "drawing them). A harder or larger training set is what would teach it more"
        )
    return (
        f'{head}; drawing them anyway ([buffer] on_solved = "continue"): every group will be '
        "flat, with nothing to learn from; stop the run, or give it harder prompts"
    )

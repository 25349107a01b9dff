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


@dataclass
class Tally:
    groups: int = 0
    flat: int = 0
    distinct: int = 0  # summed over the groups
    samples: int = 0  # summed over the groups

    def add(self, flat: bool, distinct: int, samples: int) -> None:
        self.groups += 1
        self.flat += flat
        self.distinct += distinct
        self.samples += samples

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
    streak: Tally = field(default_factory=Tally)
    warned: bool = False

    def observe(self, group: SampleGroup, trainable: bool) -> None:
        if trainable:
            self.streak, self.warned = Tally(), False
        else:
            self.streak.add(is_flat(group), distinct_completions(group), len(group.samples))

    def stalled(self, per_step: int) -> str | None:
        """The stall's one console line, when it is due (else None)."""
        if self.warned or self.limit <= 0 or self.streak.groups < self.limit:
            return None
        self.warned = True
        return stall_line(self.streak, per_step)


KEYS_THAT_HELP = (
    "[buffer] temperature (higher samples more unlike replies), samples_per_prompt, "
    "flat_rest_steps, refill_max_share, curriculum_* (easy/hard weights, retirement); "
    "[trainer.loss] entropy_coef and the trainer's entropy-control keys (docs/learning.md)"
)


def stall_line(t: Tally, per_step: int) -> str:
    """What a stall is and why, in one line (docs/learning.md, 'Collapse made visible')."""
    steps = t.groups / per_step if per_step else 0.0
    if t.flat == t.groups and t.distinct_mean <= 1.5:
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
    else:
        cause = "groups dropped by the filters or as stale (see the dead letters by reason)"
    return (
        f"no trainable group in the last {t.groups} ({steps:.1f} steps' worth): {cause}. "
        f"Keys that help: {KEYS_THAT_HELP}"
    )

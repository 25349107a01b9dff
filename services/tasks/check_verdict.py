"""The pre-flight check's arithmetic: scored replies in, figures and one verdict out.

`flywheel check` (services/tasks/check.py samples and scores; this module
judges) answers one question before a run spends its minutes: does the
base model, sampled as the rollout workers will sample it, give the
trainer anything to learn from? GRPO learns only from a group whose
replies the reward scores differently (the buffer's zero-variance filter
drops the rest), so the figures are the ones that decide that: pass@1 and
pass@k at the run's temperature, the share of groups that would be flat,
the share of all-correct groups, and the share of replies that name the
reference answer at all (a model that names it in a sentence can be
taught the form; one that never names it cannot be reached by RL).

Pure: no model, no sandbox, no I/O; the thresholds are arguments.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

EXIT_WARN = 3
"""`flywheel check`'s exit code when RL has nothing to learn from (2 is a bad run file)."""

MIN_PASS_AT_K = 0.05
"""pass@k below this reads as ~0: with the default 32 prompts, at most one prompt had a
correct reply among its k."""

MAX_UNSCORED = 0.5
"""A reward that could not be computed on at least this share of replies is broken."""


@dataclass(frozen=True)
class Reply:
    """One scored reply: its reward (the sum of the parts, as the trainer sees it),
    whether it counts as correct (`eval.part` >= `eval.threshold`), whether it names
    the reference answer (None: the row has none), and the reward's error, if any."""

    reward: float
    correct: bool
    names_answer: bool | None = None
    error: str | None = None


@dataclass(frozen=True)
class Stats:
    prompts: int
    k: int
    pass_at_1: float  # mean share of correct replies per prompt, at the run's temperature
    pass_at_k: float  # share of prompts with a correct reply among their k
    flat: float  # share of groups whose scored replies all have the same reward
    all_correct: float  # share of groups whose every reply is correct
    names_answer: float | None  # share of replies naming the answer (None: no answers)
    unscored: float  # share of replies whose reward could not be computed
    mean_reward: float  # over scored replies
    first_error: str | None = None


def names_answer(reply: str, answer: str | None) -> bool | None:
    """Whether `reply` names `answer` anywhere, as a word (case-insensitive: "Positive."
    names "positive", "positively" does not); None without an answer."""
    if answer is None or not answer.strip():
        return None
    pattern = r"(?<!\w)" + re.escape(answer.strip()) + r"(?!\w)"
    return re.search(pattern, reply, re.IGNORECASE) is not None


def flat(group: Sequence[Reply]) -> bool:
    """No reward spread among the scored replies: the buffer's zero-variance filter (and
    a group with fewer than two scored replies cannot train either)."""
    scored = {r.reward for r in group if r.error is None}
    return len(scored) <= 1


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def stats(groups: Sequence[Sequence[Reply]]) -> Stats:
    """The figures of `groups` (one per prompt, its k replies)."""
    if not groups or any(not g for g in groups):
        raise ValueError("stats: every prompt needs at least one reply")
    replies = [r for g in groups for r in g]
    scored = [r for r in replies if r.error is None]
    named = [r.names_answer for r in replies if r.names_answer is not None]
    return Stats(
        prompts=len(groups),
        k=max(len(g) for g in groups),
        pass_at_1=sum(_share([r.correct for r in g]) for g in groups) / len(groups),
        pass_at_k=_share([any(r.correct for r in g) for g in groups]),
        flat=_share([flat(g) for g in groups]),
        all_correct=_share([all(r.correct for r in g) for g in groups]),
        names_answer=_share(named) if named else None,
        unscored=1 - len(scored) / len(replies),
        mean_reward=sum(r.reward for r in scored) / len(scored) if scored else 0.0,
        first_error=next((r.error for r in replies if r.error is not None), None),
    )


class Kind(StrEnum):
    LEARNABLE = "learnable"  # some groups have a spread: RL has something to learn from
    UNREACHABLE = "unreachable"  # (almost) no reply is correct
    FLAT = "flat"  # every group flat, though some replies are correct
    SOLVED = "solved"  # every reply is correct already
    UNSCORED = "unscored"  # the reward fails on most replies


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    line: str  # one line: what the figures mean, and (a warning) what would help

    @property
    def warns(self) -> bool:
        return self.kind is not Kind.LEARNABLE

    @property
    def exit_code(self) -> int:
        return EXIT_WARN if self.warns else 0


def verdict(s: Stats, *, temperature: float, min_pass_at_k: float = MIN_PASS_AT_K) -> Verdict:
    """The one-line verdict on `s`: learnable, or a warning that names what would help.

    Order matters: a reward that fails says nothing of the replies; a solved set
    is flat too, but for the opposite reason of a stuck one (docs/learning.md)."""
    k, replies = f"pass@{s.k}", s.prompts * s.k
    spread = 1 - s.flat
    if s.unscored >= MAX_UNSCORED:
        return Verdict(Kind.UNSCORED, (
            f"WARNING: the reward could not be computed for {s.unscored:.0%} of {replies} "
            f"replies ({s.first_error}): fix [task] reward before training"
        ))  # fmt: skip
    if s.all_correct >= 1.0:
        return Verdict(Kind.SOLVED, (
            f"WARNING: every reply is already correct (pass@1 {s.pass_at_1:.3f}): RL has "
            "nothing to learn here; harder prompts would give it something"
        ))  # fmt: skip
    if s.pass_at_k < min_pass_at_k:
        if s.pass_at_k == 0 and spread > 0:  # a shaped reward: its other parts spread
            why = (f"no reply of {replies} was correct ({k} 0.000); {spread:.0%} of groups "
                   "have a reward spread from its other parts, which RL may climb toward the "
                   "answer or stop short of")  # fmt: skip
        elif s.pass_at_k == 0:
            why = (f"no reply of {replies} was correct ({k} 0.000): RL cannot reach an answer "
                   "the model never gives")  # fmt: skip
        else:
            solved = round(s.pass_at_k * s.prompts)
            why = (f"only {solved} of {s.prompts} prompts had a correct reply among its {s.k} "
                   f"({k} {s.pass_at_k:.3f}): too rare for RL to learn from")  # fmt: skip
        form = "a clearer "
        if s.names_answer:
            form = (f"{s.names_answer:.0%} of replies name the answer but the reward does not "
                    "count them: ask for the answer's form with ")  # fmt: skip
        return Verdict(Kind.UNREACHABLE, (
            f"WARNING: {why}; what would help: {form}[task] prompt_template or "
            "system_prompt, a warm start (`flywheel sft`; a tiny model: `flywheel "
            f"init-model`), or a hotter [buffer] temperature (now {temperature:g})"
        ))  # fmt: skip
    if spread <= 0.0:
        return Verdict(Kind.FLAT, (
            f"WARNING: every group is flat ({k} {s.pass_at_k:.3f}, but each prompt's "
            "replies all score alike): the trainer would get no group to learn from; what "
            f"would help: a hotter [buffer] temperature (now {temperature:g}), more "
            "[buffer] samples_per_prompt, or a reward with partial credit"
        ))  # fmt: skip
    return Verdict(Kind.LEARNABLE, (
        f"ok: {spread:.0%} of groups have a reward spread (pass@1 {s.pass_at_1:.3f}, "
        f"{k} {s.pass_at_k:.3f}): RL has something to learn from"
    ))  # fmt: skip

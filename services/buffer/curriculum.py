"""The difficulty curriculum and the resting of flat prompts (pure: no I/O).

Every group the buffer receives says how hard its prompt is for the policy
now: the share of its scored samples whose reward reaches `pass_reward`.
The buffer keeps, per prompt (its task's name and row), a pass rate over
its groups (`PromptStats`) in its durable state (services/buffer/state.py:
one small record per prompt, written with the group's decision), and draws
prompts by it (`draw`):

- a prompt never seen is drawn as always (weight 1);
- *easy* (pass rate >= `easy_pass_rate`) and *hard* (<= `hard_pass_rate`)
  prompts are drawn with probability `easy_weight` / `hard_weight` when the
  cursor reaches them: their groups are the ones most often flat (all right
  or all wrong, zero advantage), so generating them is mostly waste;
- a *retired* prompt (pass rate >= `retire_pass_rate` over at least
  `retire_after` groups) is solved: never drawn again (like prime-rl's
  difficulty pools, whose easy pool a weight of 0 retires);
- a prompt whose last group was flat (every reward alike) *rests*: it is not
  drawn before step `rest_until` (`flat_rest_steps` after it was flat).
  GRESO's observation: a prompt with no reward spread once is likely to have
  none the next time soon after.

The draw walks the epoch's shuffled order as before (services/buffer/core.py,
`advance`) and skips a position by a coin that is a pure function of the seed,
the epoch and the position, so a restarted buffer with the same stats skips
the same positions. A skipped prompt waits for the cursor's next pass (the
next epoch). If a whole epoch's worth of positions would be skipped in one
draw (every prompt retired or resting), the next position is taken anyway:
the run goes on, and `Draw.forced` says so.

The pass rate is an exponential average with weight `ema` per group,
started at the first group's share: after groups of shares s1..sn it is
s_n·a + s_(n-1)·a(1-a) + … + s1·(1-a)^(n-1), a closed form the unit tests check.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.buffer.settings import BufferSettings

PromptKey = tuple[str, int]
"""A prompt: its task's name in the run file and its row in that task's source."""


class Difficulty(StrEnum):
    UNSEEN = "unseen"
    EASY = "easy"
    NORMAL = "normal"
    HARD = "hard"
    RETIRED = "retired"


@dataclass(frozen=True)
class CurriculumParams:
    """The `[buffer] curriculum_*` and `flat_rest_steps` keys (settings.py documents them)."""

    enabled: bool = True
    pass_reward: float = 1.0
    ema: float = 0.5
    easy_pass_rate: float = 0.8
    hard_pass_rate: float = 0.0
    easy_weight: float = 0.5
    hard_weight: float = 0.5
    retire_pass_rate: float = 0.9
    retire_after: int = 2  # 0: never retire
    rest_steps: int = 0  # flat_rest_steps

    def __post_init__(self) -> None:
        if not (0 < self.ema <= 1) or self.retire_after < 0 or self.rest_steps < 0:
            raise ValueError(f"invalid curriculum {self}")
        for w in (self.easy_weight, self.hard_weight):
            if not 0 <= w <= 1:
                raise ValueError(f"invalid curriculum weight {w}")


@dataclass(frozen=True)
class PromptStats:
    """What the buffer knows of one prompt: groups seen, pass rate, rest."""

    groups: int = 0
    pass_rate: float = 0.0
    rest_until: int = 0  # not drawn while the step being filled is below this


def pass_share(rewards: Iterable[float], pass_reward: float) -> float | None:
    """The share of `rewards` that reach `pass_reward` (None: no reward)."""
    rs = list(rewards)
    return sum(r >= pass_reward for r in rs) / len(rs) if rs else None


def observe(
    stats: PromptStats | None,
    rewards: Iterable[float],
    *,
    step: int,
    params: CurriculumParams,
) -> PromptStats | None:
    """The prompt's stats after one more group with `rewards` (its scored samples), the
    step being filled being `step`; None (unchanged) when the group has no scored sample."""
    rs = list(rewards)
    share = pass_share(rs, params.pass_reward)
    if share is None:
        return stats
    old = stats or PromptStats()
    rate = share if old.groups == 0 else old.pass_rate + params.ema * (share - old.pass_rate)
    flat = len(set(rs)) <= 1
    rest = step + params.rest_steps if flat and params.rest_steps > 0 else old.rest_until
    return PromptStats(old.groups + 1, rate, rest)


def difficulty(stats: PromptStats | None, params: CurriculumParams) -> Difficulty:
    if stats is None or stats.groups == 0:
        return Difficulty.UNSEEN
    if params.retire_after > 0 and stats.groups >= params.retire_after:
        if stats.pass_rate >= params.retire_pass_rate:
            return Difficulty.RETIRED
    if stats.pass_rate >= params.easy_pass_rate:
        return Difficulty.EASY
    if stats.pass_rate <= params.hard_pass_rate:
        return Difficulty.HARD
    return Difficulty.NORMAL


def weight(d: Difficulty, params: CurriculumParams) -> float:
    """The probability a prompt of difficulty `d` is drawn when the cursor reaches it."""
    return {
        Difficulty.EASY: params.easy_weight,
        Difficulty.HARD: params.hard_weight,
        Difficulty.RETIRED: 0.0,
    }.get(d, 1.0)


def coin(seed: int, epoch: int, offset: int) -> float:
    """A uniform number in [0, 1) fixed by the position (the same after a restart)."""
    return random.Random(f"{seed}:{epoch}:{offset}:curriculum").random()


def skip_reason(
    stats: PromptStats | None, step: int, u: float, params: CurriculumParams
) -> str | None:
    """Why the prompt is not drawn now ('resting', 'easy', 'hard', 'retired'), or None.

    `u` is the position's coin: a prompt of weight w is drawn when u < w."""
    if not params.enabled or stats is None:
        return None
    d = difficulty(stats, params)
    if d is Difficulty.RETIRED:
        return str(d)
    if stats.rest_until > step:
        return "resting"
    return None if u < weight(d, params) else str(d)


@dataclass(frozen=True)
class Draw:
    cursor: tuple[int, int]  # (epoch, offset) after the draw
    taken: list[tuple[int, int]]  # (epoch, position) of each prompt drawn
    skipped: dict[str, int]  # reason -> positions skipped
    forced: int = 0  # positions taken although skipped: a whole epoch was skipped


def draw(
    cursor: tuple[int, int],
    size: int,
    n: int,
    why_skip: Callable[[int, int], str | None],
) -> Draw:
    """Take `n` prompts from `cursor` (epoch, offset) in a dataset of `size`, passing over
    the positions `why_skip(epoch, position)` gives a reason for (module docstring)."""
    epoch, offset = cursor
    taken: list[tuple[int, int]] = []
    skipped: dict[str, int] = {}
    run, forced = 0, 0  # positions skipped since the last one taken
    while len(taken) < n:
        if offset >= size:
            epoch, offset = epoch + 1, 0
        reason = why_skip(epoch, offset) if run < size else None
        if reason is None:
            forced += run >= size
            taken.append((epoch, offset))
            run = 0
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
            run += 1
        offset += 1
    return Draw((epoch, offset), taken, skipped, forced)


def census(stats: Mapping[PromptKey, PromptStats], params: CurriculumParams) -> dict[str, int]:
    """How many prompts are easy, normal, hard and retired (unseen ones are not counted)."""
    out = {str(d): 0 for d in Difficulty if d is not Difficulty.UNSEEN}
    for s in stats.values():
        d = difficulty(s, params)
        if d is not Difficulty.UNSEEN:
            out[str(d)] += 1
    return out


def params_of(s: BufferSettings) -> CurriculumParams:
    """The curriculum `[buffer]` asks for."""
    return CurriculumParams(
        enabled=s.curriculum,
        pass_reward=s.curriculum_pass_reward,
        ema=s.curriculum_ema,
        easy_pass_rate=s.curriculum_easy_pass_rate,
        hard_pass_rate=s.curriculum_hard_pass_rate,
        easy_weight=s.curriculum_easy_weight,
        hard_weight=s.curriculum_hard_weight,
        retire_pass_rate=s.curriculum_retire_pass_rate,
        retire_after=s.curriculum_retire_after,
        rest_steps=s.flat_rest_steps,
    )

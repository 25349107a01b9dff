"""Admission control: how many tasks the buffer may dispatch now (pure).

Once version v is ready on every engine, groups generated from now on have
version >= v, so they may fill batches 0 .. v + k: that is `(v + k + 1) * G`
group slots (G = groups per step). Slots already taken are the batched
groups plus those pending; tasks in flight (queued in the stream or being
generated) will take more. The buffer dispatches only while the groups the
in-flight tasks are expected to yield fit the free slots. Any group that
still arrives too late for its step is rejected as stale (dead-lettered),
so the bound holds for what is trained, whatever the timing.

Over-sampling. The filters (zero variance, length, custom) drop a share
of the groups, and only the groups they keep fill slots. A fixed
`oversample` fraction is right only when it matches that share: too
little and the batch waits for re-dispatches, too much and the excess
groups overflow past v + k and are dropped as stale after being
generated (measured: 13% of the demo's generation). So by default the
share is learned from the run (`FilterRate`) and the buffer dispatches
only what the slots are expected to take, keeping back a margin for luck
(`learned_budget`). This is AReaL's rule (in flight + buffered <=
(k + 1) x batch) with the filter's expected share added.

The trainer-bound regime. When the trainer, not generation, is the
bottleneck (a real model's step takes seconds to minutes on a CPU), every
task dispatched now is generated before the next version is ready, so every
accepted group beyond the free slots is stale: nothing later can use it.
There over-sampling must not trust a filter share learned from a handful of
groups. Measured (SmolLM2-135M, 4 groups per step, issue 28): the first
groups back were all dropped by the zero-variance filter, the learned share
read 1.0, admission dispatched its cap (5 tasks per free slot, 34 in flight),
the true share was ~0.6, and the excess groups arrived while the trainer
was still on its first step: 18 of the first 50 groups (36%) were stale.
So the learned budget uses an upper confidence bound on the share of groups
kept (`kept_share_bound`: the Wilson score bound, `margin` standard
deviations, over the groups the rate has seen), which is the estimate itself
once the rate has seen a horizon's worth. Dispatching too few costs a
round trip of generation, which the trainer-bound regime hides behind the
trainer's step; dispatching too many costs generation thrown away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    groups_per_step: int  # G
    max_staleness: int  # k
    # Extra fraction dispatched to cover filtered groups: None learns it from the
    # run's filter rate (`FilterRate`), a number fixes it.
    oversample: float | None = None
    max_oversample: float = 4.0  # cap on the learned extra fraction
    margin: float = 2.0  # standard deviations of filter luck the learned admission keeps back

    def __post_init__(self) -> None:
        bad_fixed = self.oversample is not None and self.oversample < 0
        if (
            self.groups_per_step < 1
            or self.max_staleness < 0
            or bad_fixed
            or self.max_oversample < 0
            or self.margin < 0
        ):
            raise ValueError(f"invalid policy {self}")


def slots(ready_version: int, policy: Policy) -> int:
    """Group slots that groups generated from now on may fill: batches 0 .. v + k."""
    return (ready_version + policy.max_staleness + 1) * policy.groups_per_step


def admission(
    ready_version: int,
    filled: int,
    in_flight: int,
    policy: Policy,
    filter_rate: float = 0.0,
    evidence: float = math.inf,
) -> int:
    """How many tasks may be dispatched now.

    `filled`: groups batched or pending; `in_flight`: tasks dispatched and not
    yet answered (queued in the stream or generating); `filter_rate`: the share
    of answered groups the filters drop (`FilterRate.rate`), used when the
    policy learns its over-sampling; `evidence`: how many groups that rate
    stands for (`FilterRate.evidence`; inf: the rate is known exactly).
    """
    free = slots(ready_version, policy) - filled
    if free <= 0:
        return 0
    if policy.oversample is not None:
        budget = math.ceil(free * (1.0 + policy.oversample))
    else:
        budget = learned_budget(free, filter_rate, policy, evidence)
    return max(0, budget - in_flight)


def kept_share_bound(filter_rate: float, evidence: float, z: float) -> float:
    """An upper confidence bound on p = 1 - rate, the share of groups the filters keep.

    The Wilson score interval's upper end at `z` standard deviations for a
    share p̂ seen over n = `evidence` groups:
        (p̂ + z²/2n + z·sqrt(p̂(1 - p̂)/n + z²/4n²)) / (1 + z²/n),
    which is 1 with no evidence (dispatch one task per slot, as before any
    group is seen) and tends to p̂ as n grows. Unlike p̂ ± z·sd it stays
    inside [0, 1] and is not 0 after a few dropped groups (p̂ = 0, n = 3,
    z = 2: 0.57).
    """
    p = 1.0 - min(max(filter_rate, 0.0), 1.0)
    if evidence <= 0:
        return 1.0
    if math.isinf(evidence) or z == 0:
        return p
    n, z2 = evidence, z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z2 / n))


def learned_budget(
    free: int, filter_rate: float, policy: Policy, evidence: float = math.inf
) -> int:
    """Tasks in flight that fill `free` slots without overflowing them.

    Each task becomes an accepted group with probability p = 1 - rate, taken
    at its upper confidence bound over the `evidence` seen (`kept_share_bound`:
    a rate learned from a few groups may be far off, and too high a p only
    dispatches fewer tasks now). The budget is the largest n whose accepted
    count stays within `free` even when the filter is `margin` standard
    deviations kinder than usual: n·p + margin·sqrt(n·p·(1 - p)) <= free.
    An accepted group beyond the free slots trains a batch past v + k, so
    it is stale unless its engine happened to update first: generated, then
    thrown away. Keeping the margin back costs only a later dispatch of the
    last few tasks (each arriving group re-opens admission), which the
    k-step lookahead hides. Never fewer than `free` (a group that is kept is
    never stale), never more than `free * (1 + max_oversample)`.
    """
    p = kept_share_bound(filter_rate, evidence, policy.margin)
    cap = math.floor(free * (1.0 + policy.max_oversample))
    if p <= 0.0:
        return cap
    n = free
    while n < cap:
        nxt = n + 1
        if nxt * p + policy.margin * math.sqrt(nxt * p * (1.0 - p)) > free:
            break
        n = nxt
    return n


@dataclass
class FilterRate:
    """The share of groups the filters drop, learned from the run.

    A running mean for the first `horizon` groups, then an exponential
    average over about `horizon` groups: the rate drifts as the policy
    learns (zero-variance groups are all-wrong early, all-right late).
    Not persisted: a restarted buffer learns it again, starting from 0
    (no over-sampling, so nothing is wasted while it learns).
    """

    horizon: int
    rate: float = 0.0
    observed: int = 0

    def __post_init__(self) -> None:
        if self.horizon < 1:
            raise ValueError(f"FilterRate horizon must be >= 1, not {self.horizon}")

    @property
    def evidence(self) -> float:
        """How many groups the rate stands for: all seen, up to the averaging horizon
        (an exponential average over ~`horizon` groups weighs about that many)."""
        return float(min(self.observed, self.horizon))

    def observe(self, filtered: bool) -> None:
        self.observed += 1
        alpha = 1.0 / min(self.observed, self.horizon)
        self.rate += alpha * ((1.0 if filtered else 0.0) - self.rate)

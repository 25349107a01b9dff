"""Admission: the learned over-sampling fills the staleness bound's slots
without overflowing them, so generation is not thrown away as stale."""

from __future__ import annotations

import random

import pytest

from services.buffer.admission import FilterRate, Policy, admission, learned_budget, slots
from services.buffer.core import Assembler, BufferState, Verdict
from tests.unit.buffer.test_core import group


def test_learned_budget_is_the_expectation_without_margin() -> None:
    p = Policy(groups_per_step=8, max_staleness=1, margin=0.0)
    assert learned_budget(10, 0.0, p) == 10  # nothing filtered: one task per slot
    assert learned_budget(10, 0.5, p) == 20  # half filtered: twice the slots
    assert learned_budget(10, 0.2, p) == 12  # 12 * 0.8 = 9.6 <= 10 < 13 * 0.8


def test_margin_keeps_back_tasks_but_never_below_the_free_slots() -> None:
    p = Policy(groups_per_step=8, max_staleness=1, margin=1.0)
    n = learned_budget(32, 0.3, p)
    assert 32 < n < learned_budget(32, 0.3, Policy(8, 1, margin=0.0))
    assert n * 0.7 + (n * 0.7 * 0.3) ** 0.5 <= 32  # one standard deviation of luck fits
    assert learned_budget(1, 0.3, p) == 1  # a kept group is never stale: 1 task per slot


def test_learned_budget_is_capped() -> None:
    p = Policy(groups_per_step=8, max_staleness=1, max_oversample=1.0, margin=0.0)
    assert learned_budget(10, 0.9, p) == 20  # would be 100
    assert learned_budget(10, 1.0, p) == 20  # everything filtered: the cap, not infinity


def test_admission_counts_filled_and_in_flight_against_the_bound() -> None:
    p = Policy(groups_per_step=4, max_staleness=1, margin=0.0)
    assert slots(0, p) == 8
    assert admission(0, 0, 0, p, filter_rate=0.5) == 16
    assert admission(0, 6, 2, p, filter_rate=0.5) == 2  # 2 free slots -> 4 tasks, 2 out
    assert admission(0, 8, 0, p, filter_rate=0.5) == 0  # full: wait for a version
    assert admission(1, 8, 0, p, filter_rate=0.0) == 4


def test_a_fixed_oversample_is_still_honoured() -> None:
    p = Policy(groups_per_step=4, max_staleness=0, oversample=0.5)
    assert admission(0, 0, 0, p, filter_rate=0.9) == 6  # the rate is ignored


def test_filter_rate_is_a_running_mean_then_an_exponential_average() -> None:
    r = FilterRate(horizon=4)
    assert r.rate == 0.0  # nothing seen: no over-sampling
    for dropped in (True, False, True, False):
        r.observe(dropped)
    assert r.rate == pytest.approx(0.5)  # the mean of the first `horizon`
    for _ in range(20):
        r.observe(True)
    assert r.rate > 0.99  # it follows a drift within a few horizons
    with pytest.raises(ValueError):
        FilterRate(horizon=0)


def test_the_assembler_learns_the_filters_share_but_not_staleness() -> None:
    a = Assembler(Policy(groups_per_step=2, max_staleness=0), BufferState(next_step=3))
    assert a.offer(group("same", 3, rewards=(1.0, 1.0))) == Verdict.ZERO_VARIANCE
    assert a.rate == pytest.approx(1.0)
    assert a.offer(group("old", 1)) == Verdict.STALE  # it passed the filters
    assert a.rate == pytest.approx(0.5)
    assert a.offer(group("ok", 3)) == Verdict.ACCEPTED
    assert a.rate == pytest.approx(1 / 3)
    assert a.offer(group("ok", 3)) == Verdict.DUPLICATE  # not observed again
    assert a.filter_rate is not None and a.filter_rate.observed == 3


def simulate(
    policy: Policy, filter_share: float, seed: int, *, arrivals: int, steps: int = 60
) -> tuple[int, int]:
    """A k-step-ahead run with random filter luck and a little reordering.

    Each round the buffer dispatches what admission allows, then up to
    `arrivals` tasks come back, each one of the three oldest in flight
    (workers take tasks in stream order; generation times differ), as a
    group generated with the version it was dispatched at and dropped by
    the filter with probability `filter_share`; every fourth round the
    trainer trains the next batch if it has one, ready at once. `arrivals`
    sets the regime: 4 a round generates twice as fast as the trainer
    trains 8-group batches (the demo: the trainer is busy), 1 a round half
    as fast (the trainer waits). Returns (stale groups, groups received).
    """
    rng = random.Random(seed)

    def luck(g: object) -> str | None:
        return "zero_variance" if rng.random() < filter_share else None

    asm = Assembler(policy, BufferState(), filters=(luck,))
    ready, in_flight, received, stale, rounds, batches = 0, list[int](), 0, 0, 0, 0
    while ready < steps:
        rounds += 1
        n = admission(ready, asm.filled, asm.state.in_flight, policy, asm.rate)
        asm.state.dispatched += n
        in_flight += [ready] * n
        for _ in range(min(arrivals, len(in_flight))):
            version = in_flight.pop(rng.randrange(min(3, len(in_flight))))
            received += 1
            stale += asm.offer(group(f"g{received}", version)) == Verdict.STALE
        while asm.take_batch() is not None:
            batches += 1
        if rounds % 4 == 0 and batches > ready:
            ready += 1
    return stale, received


def stale_share(policy: Policy, filter_share: float, arrivals: int) -> float:
    runs = [simulate(policy, filter_share, seed, arrivals=arrivals) for seed in range(5)]
    stale, received = map(sum, zip(*runs, strict=True))
    return stale / received


@pytest.mark.parametrize("share", [0.05, 0.3, 0.6])
def test_learned_admission_wastes_almost_nothing_when_the_trainer_is_busy(share: float) -> None:
    assert stale_share(Policy(8, 1), share, arrivals=4) <= 0.02


def test_a_fixed_oversample_above_the_filter_share_overflows_into_stale_groups() -> None:
    assert stale_share(Policy(8, 1, oversample=0.25), 0.05, arrivals=4) > 0.05


@pytest.mark.parametrize("share", [0.05, 0.3, 0.6])
def test_when_the_trainer_waits_over_sampling_adds_little_to_reordering(share: float) -> None:
    """Generation slower than training: a task overtaken at a version boundary
    is stale even without over-sampling (it loses its slot to a newer group);
    the learned over-sampling adds little on top of that floor."""
    floor = stale_share(Policy(8, 1, oversample=0.0), share, arrivals=1)
    assert stale_share(Policy(8, 1), share, arrivals=1) <= floor + 0.03

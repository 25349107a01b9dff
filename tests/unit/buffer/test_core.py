"""The buffer's pure core: admission arithmetic, filters, staleness, dedupe, and a
property test of the staleness bound over arbitrary interleavings."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.messages import Sample, SampleGroup, pack_f32, pack_i32, pack_u8
from services.buffer.admission import Policy, admission, slots
from services.buffer.core import (
    Assembler,
    BufferState,
    Cursor,
    Verdict,
    advance,
    epoch_order,
    max_length,
    settled_horizon,
    task_id,
)


def group(
    gid: str,
    version: int,
    rewards: tuple[float, ...] = (0.0, 1.0),
    tokens: int = 3,
    failed: tuple[int, ...] = (),
):
    """A group of one sample per reward; the samples at `failed` have no reward (a
    verifier that timed out: reward 0 and its error, as the rollout worker sends them)."""
    samples = tuple(
        Sample(
            sample_id=f"{gid}:s{i}",
            group_id=gid,
            task_id=gid,
            index=i,
            prompt_ids=pack_i32([1, 2]),
            response_ids=pack_i32(range(tokens)),
            logprobs=pack_f32([0.0] * tokens),
            loss_mask=pack_u8([1] * tokens),
            reward=r,
            finish_reason="stop",
            weight_version=version,
            weight_version_last=version,
            engine_id="e",
            verifier_error="verifier f timed out after 1.0s" if i in failed else None,
        )
        for i, r in enumerate(rewards)
    )
    return SampleGroup(
        run="r", group_id=gid, task_id=gid, task_name="t", worker_id="w", samples=samples
    )


# ── cursor ──
def test_cursor_wraps_epochs_and_orders_are_seeded() -> None:
    cur, taken = advance(Cursor(0, 3), size=4, n=3)
    assert taken == [(0, 3), (1, 0), (1, 1)]
    assert cur == Cursor(1, 2)
    assert epoch_order(7, 0, 10) == epoch_order(7, 0, 10)
    assert epoch_order(7, 0, 10) != epoch_order(7, 1, 10)
    assert sorted(epoch_order(7, 1, 10)) == list(range(10))
    assert task_id("run", 2, 5) == "run:e2:i5"


# ── admission arithmetic ──
@pytest.mark.parametrize(
    ("k", "v", "filled", "in_flight", "expected"),
    [
        # k = 0: only batch v may be filled by version-v groups.
        (0, 0, 0, 0, 4),
        (0, 0, 0, 4, 0),
        (0, 0, 3, 0, 1),
        (0, 2, 8, 0, 4),  # batches 0, 1 done; batch 2 open
        (0, 2, 12, 0, 0),  # batch 2 full, waiting for version 3
        # k = 1: batches up to v + 1.
        (1, 0, 0, 0, 8),
        (1, 0, 4, 3, 1),
        (1, 3, 16, 0, 4),
        # k = 3: batches up to v + 3.
        (3, 0, 0, 0, 16),
        (3, 1, 5, 10, 5),
        (3, 1, 20, 0, 0),
    ],
)
def test_admission_arithmetic(k: int, v: int, filled: int, in_flight: int, expected: int) -> None:
    policy = Policy(groups_per_step=4, max_staleness=k, oversample=0.0)
    assert slots(v, policy) == (v + k + 1) * 4
    assert admission(v, filled, in_flight, policy) == expected


def test_oversample_adds_a_fraction_of_free_slots() -> None:
    policy = Policy(groups_per_step=4, max_staleness=0, oversample=0.5)
    assert admission(0, 0, 0, policy) == 6
    assert admission(0, 2, 0, policy) == 3
    assert admission(0, 4, 0, policy) == 0  # never beyond the bound once full


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Policy(groups_per_step=0, max_staleness=0)
    with pytest.raises(ValueError):
        Policy(groups_per_step=1, max_staleness=-1)


# ── filters, staleness, dedupe ──
def test_zero_variance_and_length_filters() -> None:
    a = Assembler(Policy(2, 0), BufferState(), filters=(max_length(4),))
    assert a.offer(group("long", 0, tokens=5)) == Verdict.TOO_LONG
    b = Assembler(Policy(2, 0), BufferState())
    assert b.offer(group("same", 0, rewards=(1.0, 1.0))) == Verdict.ZERO_VARIANCE
    assert b.offer(group("diff", 0, rewards=(1.0, 0.0))) == Verdict.ACCEPTED
    assert b.state.answered == 2 and b.state.settled == {"same": (0, "zero_variance")}
    # Redelivered: the same drop reason again (to re-dead-letter), counted once.
    assert b.offer(group("same", 0, rewards=(1.0, 1.0))) == Verdict.ZERO_VARIANCE
    assert b.state.answered == 2


def test_samples_without_a_reward_are_left_out_and_too_few_scored_drop_the_group() -> None:
    a = Assembler(Policy(1, 0), BufferState())
    # 8 samples, the right answers' (1.0) checks of samples 0 and 1 timed out (reward 0).
    kept = group("g", 0, rewards=(0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0), failed=(0, 1))
    assert a.offer(kept) == Verdict.ACCEPTED
    _, [trained] = a.take_batch() or (-1, [])
    assert [s.index for s in trained.samples] == [2, 3, 4, 5, 6, 7]
    assert all(s.verifier_error is None for s in trained.samples)
    # Default: half the group must be scored (4 of 8); 3 are not enough.
    few = group("h", 0, rewards=(0.0,) * 5 + (1.0, 0.0, 0.0), failed=(0, 1, 2, 3, 4))
    assert a.offer(few) == Verdict.UNSCORED
    assert a.state.settled["h"] == (1, "unscored")
    # The filters see the scored samples only: these are all 0, however many failed.
    same = group("z", 0, rewards=(0.0, 0.0, 0.0, 0.0), failed=(0,))
    assert a.offer(same) == Verdict.ZERO_VARIANCE
    # The setting overrides the default; a group of 2 needs both (at least 2, at most n).
    b = Assembler(Policy(1, 0), BufferState(), min_scored=3)
    assert b.offer(group("few", 0, rewards=(0.0, 1.0, 1.0, 0.0), failed=(0, 3))) == "unscored"
    assert b.offer(group("ok", 0, rewards=(0.0, 1.0, 1.0, 0.0), failed=(0,))) == "accepted"
    c = Assembler(Policy(1, 0), BufferState())
    assert c.offer(group("pair", 0, failed=(1,))) == Verdict.UNSCORED


def test_custom_filter_reason_is_reported() -> None:
    a = Assembler(
        Policy(1, 0), BufferState(), filters=(lambda g: "no_odd" if "1" in g.group_id else None,)
    )
    assert a.offer(group("g1", 0)) == "no_odd"
    assert a.offer(group("g2", 0)) == Verdict.ACCEPTED


def test_staleness_is_checked_against_the_step_a_group_would_train_at() -> None:
    a = Assembler(Policy(groups_per_step=2, max_staleness=1), BufferState(next_step=3))
    assert a.offer(group("old", 1)) == Verdict.STALE  # 1 < 3 - 1
    assert a.offer(group("ok1", 2)) == Verdict.ACCEPTED  # step 3
    assert a.offer(group("ok2", 2)) == Verdict.ACCEPTED  # step 3
    assert a.offer(group("late", 2)) == Verdict.STALE  # would train at step 4: 2 < 4 - 1
    assert a.offer(group("new", 3)) == Verdict.ACCEPTED
    assert a.take_batch() is not None
    assert a.take_batch() is None


def test_duplicates_are_dropped_pending_and_settled() -> None:
    a = Assembler(Policy(groups_per_step=2, max_staleness=0), BufferState())
    assert a.offer(group("g", 0)) == Verdict.ACCEPTED
    assert a.offer(group("g", 0)) == Verdict.DUPLICATE
    assert a.offer(group("h", 0)) == Verdict.ACCEPTED
    step, groups = a.take_batch() or (-1, [])
    assert step == 0 and [g.group_id for g in groups] == ["g", "h"]
    assert a.offer(group("h", 0)) == Verdict.DUPLICATE
    assert a.state.answered == 2 and a.state.next_step == 1
    a.forget_before(1)
    assert a.state.settled == {}


def test_settled_ids_are_kept_for_a_time_not_only_for_steps() -> None:
    """Steps 0..9 began one second apart; ids settled at a step are forgotten only
    once the next step began `keep_s` ago (their messages may come back that late)."""
    starts = {s: 100.0 + s for s in range(10)}
    assert settled_horizon(starts, now=109.0, keep_s=60) is None  # nothing that old
    assert settled_horizon(starts, now=160.0, keep_s=60) == 0  # step 0 began 60 s ago
    assert settled_horizon(starts, now=163.5, keep_s=60) == 3  # ids of steps 0..2 may go
    assert settled_horizon(starts, now=500.0, keep_s=60) == 9
    assert settled_horizon({}, now=500.0, keep_s=0) is None


# ── property: the staleness bound holds for any interleaving ──
@dataclass
class World:
    """A buffer, a trainer and engines, advanced by a random schedule of events."""

    policy: Policy
    asm: Assembler = field(init=False)
    ready: int = 0  # version every engine serves
    trained: int = 0  # steps the trainer finished (= newest version published)
    in_flight: list[int] = field(default_factory=list)  # generation version of each task
    batches: dict[int, list[SampleGroup]] = field(default_factory=dict)
    next_id: int = 0

    def __post_init__(self) -> None:
        self.asm = Assembler(self.policy, BufferState(), filters=(_odd_dropped,))

    def dispatch(self) -> None:
        n = admission(
            self.ready, self.asm.filled, self.asm.state.in_flight, self.policy, self.asm.rate
        )
        extra = self.policy.oversample
        bound = slots(self.ready, self.policy) * (
            1 + (self.policy.max_oversample if extra is None else extra)
        )
        for _ in range(n):
            self.asm.state.dispatched += 1
            self.in_flight.append(self.ready)
            # No task beyond the bound: in flight + filled within the scaled slots.
            assert self.asm.state.in_flight + self.asm.filled <= bound + 1

    def arrive(self, which: int, newer: bool) -> None:
        if not self.in_flight:
            return
        version = self.in_flight.pop(which % len(self.in_flight))
        if newer:  # the engine was updated before this task started
            version = self.ready
        self.next_id += 1
        self.asm.offer(group(f"g{self.next_id}", version, rewards=(0.0, float(self.next_id))))
        while (b := self.asm.take_batch()) is not None:
            self.batches[b[0]] = b[1]

    def train(self) -> None:
        if self.trained in self.batches:
            self.trained += 1

    def sync(self) -> None:
        self.ready = self.trained


def _odd_dropped(g: SampleGroup) -> str | None:
    return "odd" if int(g.group_id[1:]) % 3 == 0 else None


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(0, 3),
    groups_per_step=st.integers(1, 4),
    oversample=st.sampled_from([None, 0.0, 0.25, 1.0]),
    events=st.lists(
        st.tuples(st.sampled_from("daats"), st.integers(0, 50), st.booleans()), max_size=300
    ),
)
def test_every_batch_respects_the_staleness_bound(
    k: int, groups_per_step: int, oversample: float | None, events: list[tuple[str, int, bool]]
) -> None:
    w = World(Policy(groups_per_step, k, oversample))
    for kind, which, newer in events:
        if kind == "a":
            w.arrive(which, newer)
        else:
            {"d": w.dispatch, "t": w.train, "s": w.sync}[kind]()
    for step, groups in w.batches.items():
        assert len(groups) == groups_per_step
        assert all(g.weight_version >= step - k for g in groups), step
    ids = [g.group_id for gs in w.batches.values() for g in gs]
    assert len(ids) == len(set(ids))
    assert sorted(w.batches) == list(range(len(w.batches)))


def test_synchronous_run_makes_progress() -> None:
    """k = 0 with no drops: dispatch, generate, train, sync — one batch per version."""
    w = World(Policy(groups_per_step=3, max_staleness=0))
    w.asm.filters = ()
    for _ in range(5):
        w.dispatch()
        while w.in_flight:
            w.arrive(0, newer=False)
        w.train()
        w.sync()
    assert w.trained == 5 and len(w.batches) == 5

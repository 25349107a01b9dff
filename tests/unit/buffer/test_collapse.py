"""Flat groups and collapse made visible (services/buffer/collapse.py), and the refill of
a flat group's slot with a recent group (services/buffer/core.py, Assembler)."""

from __future__ import annotations

from proto.messages import Sample, SampleGroup, pack_f32, pack_i32, pack_u8
from services.buffer.admission import Policy
from services.buffer.collapse import (
    StallWatch,
    StepWindow,
    Tally,
    all_solved_line,
    distinct_completions,
    is_flat,
    is_solved,
    retirement_note,
    stall_line,
)
from services.buffer.core import Assembler, BufferState, Verdict, position_of, task_id
from tests.unit.buffer.test_core import group


def replies(gid: str, texts: list[list[int]], rewards: list[float], version: int = 0):
    """A group whose sample i answered the token ids `texts[i]` for `rewards[i]`."""
    samples = tuple(
        Sample(
            sample_id=f"{gid}:s{i}",
            group_id=gid,
            task_id=gid,
            index=i,
            prompt_ids=pack_i32([1]),
            response_ids=pack_i32(t),
            logprobs=pack_f32([0.0] * len(t)),
            loss_mask=pack_u8([1] * len(t)),
            reward=r,
            finish_reason="stop",
            weight_version=version,
            weight_version_last=version,
            engine_id="e",
        )
        for i, (t, r) in enumerate(zip(texts, rewards, strict=True))
    )
    return SampleGroup(
        run="r", group_id=gid, task_id=gid, task_name="t", worker_id="w", samples=samples
    )


SENTENCE = [10, 11, 12, 13]  # "The last word in this list is button."


def test_distinct_completions_count_token_sequences_not_rewards() -> None:
    collapsed = replies("a", [SENTENCE] * 8, [0.15] * 8)
    assert distinct_completions(collapsed) == 1 and is_flat(collapsed)
    # different replies, same reward: still flat (every sample earns the same)
    alike = replies("b", [[1], [2], [3], [1]], [1.0] * 4)
    assert distinct_completions(alike) == 3 and is_flat(alike)
    spread = replies("c", [[1], [1], [2, 3]], [0.0, 0.0, 1.0])
    assert distinct_completions(spread) == 2 and not is_flat(spread)


def test_a_verifier_error_is_no_reward_for_flatness() -> None:
    g = group("g", 0, rewards=(0.0, 1.0, 1.0), failed=(0,))  # the 0.0 is a timed-out check
    assert is_flat(g)


def test_step_window_shows_the_last_step_then_a_stalled_step_live() -> None:
    w = StepWindow(per_step=2)
    for gid in ("a", "b", "c"):
        w.add(replies(gid, [[1], [2]], [0.0, 1.0]))
    w.add(replies("d", [SENTENCE] * 2, [0.0, 0.0]))
    assert w.shown().flat_share == 0.25  # the first step: nothing before it
    w.closed()
    assert w.shown().flat_share == 0.25 and w.shown().distinct_mean == 1.75
    w.add(replies("e", [SENTENCE] * 2, [0.0, 0.0]))
    assert w.shown().flat_share == 0.25  # one group of a step of 2: the last step still
    w.add(replies("f", [SENTENCE] * 2, [0.0, 0.0]))
    shown = w.shown()  # a step's worth without a batch: the stall shows itself
    assert (shown.flat_share, shown.distinct_mean, shown.group_size) == (1.0, 1.0, 2.0)


def test_a_stall_is_said_once_with_its_cause_and_rearmed_by_a_trainable_group() -> None:
    watch = StallWatch(limit=6)
    flat = replies("x", [SENTENCE] * 8, [0.15] * 8)
    lines = []
    for _ in range(20):
        watch.observe(flat, trainable=False)
        lines.append(watch.stalled(per_step=4))
    said = [ln for ln in lines if ln]
    assert len(said) == 1 and lines.index(said[0]) == 5  # at the 6th group, once
    assert "no trainable group in the last 6 (1.5 steps' worth)" in said[0]
    assert "every group flat and 1.0 distinct completions of 8 per group" in said[0]
    for key in ("temperature", "flat_rest_steps", "refill_max_share", "curriculum_",
                "entropy"):  # fmt: skip
        assert key in said[0]
    watch.observe(replies("y", [[1], [2]], [0.0, 1.0]), trainable=True)
    assert watch.streak.groups == 0
    for _ in range(6):
        watch.observe(flat, trainable=False)
    assert watch.stalled(per_step=4) is not None  # a new stall is said again
    assert StallWatch(limit=0).stalled(4) is None


def test_the_stall_line_tells_flat_from_other_causes() -> None:
    alike = Tally(groups=8, flat=6, distinct=24, samples=64)
    assert "75% of groups flat" in stall_line(alike, 4)
    assert "3.0 distinct completions of 8" in stall_line(alike, 4)
    stale = Tally(groups=8, flat=1, distinct=40, samples=64)
    assert "stale" in stall_line(stale, 4)


def stalled_on(groups: list[SampleGroup], pass_reward: float = 1.0) -> str:
    watch = StallWatch(limit=len(groups), pass_reward=pass_reward)
    for g in groups:
        watch.observe(g, trainable=False)
    line = watch.stalled(per_step=4, retiring=retirement_note(3, 6, True, "stop"))
    assert line is not None
    return line


def test_flat_because_every_reply_is_right_is_solved_not_a_collapse() -> None:
    """The demo at 0.89 validation: one right answer, said alike by every sample of every
    group, is flat and of 1 distinct completion, as a collapse is; it is solved."""
    right = [replies(f"r{i}", [SENTENCE] * 8, [1.0] * 8) for i in range(8)]
    assert all(is_flat(g) and is_solved(g, 1.0) for g in right)
    line = stalled_on(right)
    assert line == (
        "no trainable group in the last 8 (2.0 steps' worth): every reply of every group "
        "earned the top reward: these prompts are solved, not stuck (no collapse; nothing "
        "is left to learn from them). The curriculum retires solved prompts (3 of 6 retired "
        'so far); when all are, the run stops ([buffer] on_solved = "stop")'
    )
    assert "collapse)" not in line and "Keys that help" not in line
    # right by the run's own bar: a shaped reward whose right answer earns 0.8
    shaped = [replies(f"s{i}", [SENTENCE] * 4, [0.8] * 4) for i in range(4)]
    assert "solved, not stuck" in stalled_on(shaped, pass_reward=0.8)
    assert "collapse" in stalled_on(shaped, pass_reward=1.0)  # below the bar: alike


def test_flat_groups_of_wrong_or_alike_replies_are_still_a_collapse_with_the_keys() -> None:
    wrong = [replies(f"w{i}", [SENTENCE] * 8, [0.0] * 8) for i in range(8)]
    assert not is_solved(wrong[0], 1.0)
    line = stalled_on(wrong)
    assert "the policy answers every prompt alike (collapse)" in line
    assert "Keys that help: [buffer] temperature" in line and "solved" not in line
    # some solved, some wrong: flat groups, told apart, with the keys
    mixed = [replies(f"m{i}", [[i], [i + 1]], [1.0, 1.0]) for i in range(3)]
    mixed += [replies(f"n{i}", [[i], [i + 1]], [0.0, 0.0]) for i in range(5)]
    line = stalled_on(mixed)
    assert "100% of groups flat" in line
    assert "(3 of them solved, every reply right; the other 5, every reply wrong or alike)" in line
    assert "Keys that help" in line


def test_what_becomes_of_solved_prompts_and_of_a_solved_training_set() -> None:
    assert "do not retire" not in retirement_note(0, 6, True, "continue")
    assert "when all are, the run goes on drawing them" in retirement_note(0, 6, True, "continue")
    assert "does not retire solved prompts" in retirement_note(0, 6, False, "stop")
    assert all_solved_line(6, 0.9, 2, "stop") == (
        "the whole training set is solved: every one of its 6 prompts is retired (pass rate "
        '>= 0.9 over at least 2 groups); stopping the run ([buffer] on_solved = "stop"; '
        '"continue" goes on drawing them). A harder or larger training set is what would '
        "teach it more"
    )
    assert "drawing them anyway" in all_solved_line(6, 0.9, 2, "continue")


# ── refill ──
def spread(gid: str, version: int) -> SampleGroup:
    return group(gid, version, rewards=(0.0, 1.0))


def flat(gid: str, version: int) -> SampleGroup:
    return group(gid, version, rewards=(1.0, 1.0))


def test_a_flat_groups_slot_is_refilled_from_a_recent_group_at_most_once() -> None:
    a = Assembler(Policy(2, 1), BufferState(), refill_max=1, refill_max_staleness=1)
    assert a.offer(spread("a", 0)) == Verdict.ACCEPTED
    assert a.offer(flat("f0", 0)) == Verdict.ZERO_VARIANCE and a.last_refill is None  # none yet
    assert a.offer(spread("b", 0)) == Verdict.ACCEPTED
    step, groups = a.take_batch() or (-1, [])
    assert step == 0 and [g.group_id for g in groups] == ["a", "b"]
    # step 1 fills: a flat group's slot takes the newest recent group (b), once
    assert a.offer(flat("f1", 0)) == Verdict.ZERO_VARIANCE
    assert a.last_refill is not None and a.last_refill.group_id == "b"
    assert a.offer(flat("f2", 0)) == Verdict.ZERO_VARIANCE
    assert a.last_refill is None  # refill_max 1 per batch
    assert a.offer(spread("c", 1)) == Verdict.ACCEPTED
    step, groups = a.take_batch() or (-1, [])
    assert step == 1 and [g.group_id for g in groups] == ["b", "c"]
    assert a.state.settled["b"] == (1, Verdict.ACCEPTED)
    # b trained twice: never again; a (version 0) is too stale for step 2 (w >= 2 - 1)
    assert [g.group_id for g in a.recent] == ["c"]
    assert a.offer(flat("f3", 1)) == Verdict.ZERO_VARIANCE
    assert a.last_refill is not None and a.last_refill.group_id == "c"


def test_refills_respect_their_staleness_bound_and_keep_the_filter_rate_honest() -> None:
    a = Assembler(Policy(1, 5), BufferState(), refill_max=1, refill_max_staleness=0)
    assert a.offer(spread("old", 0)) == Verdict.ACCEPTED
    a.take_batch()
    assert a.offer(flat("f", 1)) == Verdict.ZERO_VARIANCE
    assert a.last_refill is None  # version 0 at step 1 with a bound of 0: too stale
    assert a.rate > 0  # the flat group counted as filtered: admission over-samples
    b = Assembler(Policy(1, 5), BufferState(), refill_max=1, refill_max_staleness=1)
    b.offer(spread("old", 0))
    b.take_batch()
    b.offer(flat("f", 1))
    assert b.last_refill is not None and b.rate == 0.0  # the slot was filled


def test_max_staleness_bounds_a_refill_as_it_bounds_any_sample() -> None:
    """refill_max_staleness 2, but max_staleness 0 (synchronous) refills nothing and
    max_staleness 1 refuses a group 2 versions behind."""
    sync = Assembler(Policy(1, 0), BufferState(), refill_max=1, refill_max_staleness=2)
    assert sync.offer(spread("a", 0)) == Verdict.ACCEPTED
    sync.take_batch()
    assert sync.offer(flat("f", 1)) == Verdict.ZERO_VARIANCE
    assert sync.last_refill is None and not sync.recent  # on-policy: nothing trains twice
    one = Assembler(Policy(1, 1), BufferState(), refill_max=1, refill_max_staleness=2)
    one.offer(spread("a", 0))
    one.take_batch()  # step 0
    one.offer(spread("b", 1))
    one.take_batch()  # step 1
    # step 2 is next: a (v0) would be 2 behind, over max_staleness 1: no longer a candidate
    assert [g.group_id for g in one.recent] == ["b"]
    assert one.offer(flat("f", 1)) == Verdict.ZERO_VARIANCE
    assert one.last_refill is not None and one.last_refill.group_id == "b"


def test_refill_is_off_by_default() -> None:
    a = Assembler(Policy(1, 1), BufferState())
    a.offer(spread("a", 0))
    a.take_batch()
    assert a.offer(flat("f", 0)) == Verdict.ZERO_VARIANCE
    assert a.last_refill is None and not a.recent


def test_task_positions_parse_back() -> None:
    assert position_of(task_id("my:run", 3, 17)) == (3, 17)
    assert position_of("something-else") is None

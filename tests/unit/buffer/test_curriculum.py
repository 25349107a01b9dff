"""The difficulty curriculum (services/buffer/curriculum.py): pass rates against their
closed forms, difficulty classes, retirement, rest, the skipping draw and its coin,
and the records that keep it across a restart (services/buffer/state.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.buffer.curriculum import (
    CurriculumParams,
    Difficulty,
    PromptStats,
    census,
    coin,
    difficulty,
    draw,
    observe,
    pass_share,
    skip_reason,
)
from services.buffer.state import (
    PROMPT_PREFIX,
    BufferRecordError,
    dump_prompt,
    load_prompt,
    prompt_key,
    recover,
)

P = CurriculumParams()


def run_groups(shares: list[float], params: CurriculumParams = P, n: int = 8) -> PromptStats:
    """The stats after groups of `n` samples whose pass shares are `shares` (k/n each)."""
    stats = None
    for s in shares:
        k = round(s * n)
        stats = observe(stats, [1.0] * k + [0.0] * (n - k), step=0, params=params)
    assert stats is not None
    return stats


def test_pass_share_counts_rewards_at_or_above_the_pass_reward() -> None:
    assert pass_share([1.0, 0.0, 1.5, 0.99], 1.0) == 0.5
    assert pass_share([0.3, 0.35], 0.35) == 0.5
    assert pass_share([], 1.0) is None


@given(st.lists(st.integers(0, 8), min_size=1, max_size=20), st.sampled_from([0.1, 0.5, 1.0]))
def test_pass_rate_is_the_exponential_average_started_at_the_first_group(
    passes: list[int], a: float
) -> None:
    params = CurriculumParams(ema=a)
    shares = [k / 8 for k in passes]
    got = run_groups(shares, params)
    # closed form: s_n·a + s_(n-1)·a(1-a) + … + s_2·a(1-a)^(n-2) + s_1·(1-a)^(n-1)
    n = len(shares)
    want = shares[0] * (1 - a) ** (n - 1) + sum(
        shares[i] * a * (1 - a) ** (n - 1 - i) for i in range(1, n)
    )
    assert got.groups == n
    assert math.isclose(got.pass_rate, want, abs_tol=1e-12)


def test_a_failed_group_then_passes_approach_one_geometrically() -> None:
    for n in range(1, 6):
        assert math.isclose(run_groups([0.0] + [1.0] * n).pass_rate, 1 - 0.5**n)


def test_a_group_without_a_scored_sample_changes_nothing() -> None:
    before = PromptStats(2, 0.25, 0)
    assert observe(before, [], step=3, params=P) is before
    assert observe(None, [], step=3, params=P) is None


def test_difficulty_classes_and_retirement() -> None:
    assert difficulty(None, P) is Difficulty.UNSEEN
    assert difficulty(run_groups([0.0]), P) is Difficulty.HARD  # never passed
    assert difficulty(run_groups([0.5]), P) is Difficulty.NORMAL
    assert difficulty(run_groups([1.0]), P) is Difficulty.EASY  # one group: not yet retired
    assert difficulty(run_groups([1.0, 0.875]), P) is Difficulty.RETIRED  # 0.9375 >= 0.9
    # 0.5 then 1.0 at ema 0.5: 0.75, below the easy threshold (0.8)
    assert run_groups([0.5, 1.0]).pass_rate == 0.75
    assert difficulty(run_groups([0.5, 1.0]), P) is Difficulty.NORMAL
    never = CurriculumParams(retire_after=0)
    assert difficulty(run_groups([1.0] * 10, never), never) is Difficulty.EASY


def test_skip_reasons_follow_the_weights_and_the_rest() -> None:
    easy, hard = run_groups([1.0]), run_groups([0.0])
    assert skip_reason(None, 0, 0.99, P) is None  # unseen: always drawn
    assert skip_reason(easy, 0, 0.49, P) is None and skip_reason(easy, 0, 0.5, P) == "easy"
    assert skip_reason(hard, 0, 0.49, P) is None and skip_reason(hard, 0, 0.5, P) == "hard"
    assert skip_reason(run_groups([1.0, 1.0]), 0, 0.0, P) == "retired"
    resting = PromptStats(1, 0.5, rest_until=7)
    assert skip_reason(resting, 6, 0.0, P) == "resting"
    assert skip_reason(resting, 7, 0.0, P) is None  # rested enough
    off = CurriculumParams(enabled=False)
    assert skip_reason(run_groups([1.0, 1.0]), 0, 0.9, off) is None


def test_a_flat_group_rests_its_prompt_for_the_configured_steps() -> None:
    params = CurriculumParams(rest_steps=4)
    flat = observe(None, [0.15] * 8, step=10, params=params)
    assert flat is not None and flat.rest_until == 14
    spread = observe(flat, [0.0, 1.0] * 4, step=11, params=params)
    assert spread is not None and spread.rest_until == 14  # a spread does not extend it
    unrested = observe(None, [0.0] * 8, step=10, params=CurriculumParams())
    assert unrested is not None and unrested.rest_until == 0  # rest_steps 0: never rests


def test_the_coin_is_a_pure_function_of_the_position() -> None:
    assert coin(3, 1, 7) == coin(3, 1, 7)
    us = [coin(0, 0, i) for i in range(2000)]
    assert len(set(us)) == 2000 and all(0 <= u < 1 for u in us)
    # uniform: the share under w is w, within 4 standard deviations
    for w in (0.25, 0.5, 0.75):
        share = sum(u < w for u in us) / len(us)
        assert abs(share - w) < 4 * math.sqrt(w * (1 - w) / len(us))


def test_draw_passes_over_skipped_positions_and_wraps_epochs() -> None:
    skip = {(0, 1): "easy", (0, 2): "retired", (1, 0): "resting"}
    got = draw((0, 0), 4, 3, lambda e, o: skip.get((e, o)))
    assert got.taken == [(0, 0), (0, 3), (1, 1)]
    assert got.cursor == (1, 2)
    assert got.skipped == {"easy": 1, "retired": 1, "resting": 1}
    assert got.forced == 0
    # without skips it is the plain cursor (core.advance)
    plain = draw((0, 3), 4, 3, lambda e, o: None)
    assert plain.taken == [(0, 3), (1, 0), (1, 1)] and plain.cursor == (1, 2)


def test_draw_takes_a_prompt_anyway_when_a_whole_epoch_is_skipped() -> None:
    got = draw((0, 0), 5, 2, lambda e, o: "retired")
    assert len(got.taken) == 2 and got.forced == 2
    assert got.skipped == {"retired": 5 + 5}  # one epoch's worth before each forced take


@given(st.dictionaries(st.integers(0, 19), st.sampled_from(["easy", "hard"])),
       st.integers(1, 30))  # fmt: skip
def test_draw_takes_exactly_n_and_never_a_skipped_position(skips: dict[int, str], n: int) -> None:
    got = draw((0, 0), 20, n, lambda e, o: skips.get(o))
    assert len(got.taken) == n
    if len(skips) < 20:
        assert not any(o in skips for _, o in got.taken)
        assert sum(got.skipped.values()) + n == got.cursor[0] * 20 + got.cursor[1]


def test_census_counts_prompts_by_difficulty() -> None:
    stats = {
        ("t", 0): run_groups([1.0]),
        ("t", 1): run_groups([1.0, 1.0]),
        ("t", 2): run_groups([0.0]),
        ("t", 3): run_groups([0.5]),
        ("u", 0): run_groups([0.25]),
    }
    assert census(stats, P) == {"easy": 1, "normal": 2, "hard": 1, "retired": 1}


def test_params_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        CurriculumParams(ema=0.0)
    with pytest.raises(ValueError):
        CurriculumParams(easy_weight=1.5)


# ── durable records ──
def test_prompt_records_round_trip_and_are_merged_by_recover() -> None:
    a, b = PromptStats(3, 0.625, 12), PromptStats(1, 0.0, 0)
    entries = {
        prompt_key(("last_word", 17)): dump_prompt(a),
        prompt_key(("a.b:c d", 0)): dump_prompt(b),  # any task name
    }
    assert all(k.startswith(PROMPT_PREFIX) for k in entries)
    rec = recover(entries)
    assert rec.prompts == {("last_word", 17): a, ("a.b:c d", 0): b}


def test_a_bad_prompt_record_names_its_key() -> None:
    key = prompt_key(("t", 1))
    import msgpack

    with pytest.raises(BufferRecordError, match="pass rate"):
        load_prompt(key, msgpack.packb({"g": 1, "p": 1.5, "r": 0}))
    with pytest.raises(BufferRecordError, match="lacks"):
        load_prompt(key, msgpack.packb({"g": 1}))
    with pytest.raises(BufferRecordError, match="not a prompt record key"):
        load_prompt(PROMPT_PREFIX + "dA==.x", dump_prompt(PromptStats()))

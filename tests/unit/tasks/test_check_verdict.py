"""The pre-flight check's figures and verdict (services/tasks/check_verdict.py), from
hand-made scored replies: what each case means for a GRPO run, and its exit code."""

from __future__ import annotations

import pytest

from services.tasks.check_verdict import (
    EXIT_WARN,
    Kind,
    Reply,
    names_answer,
    stats,
    verdict,
)

RIGHT, WRONG = Reply(1.0, True, True), Reply(0.0, False, False)


def test_names_answer_as_a_word_in_any_case() -> None:
    assert names_answer("The review is Positive.", "positive") is True
    assert names_answer("positively great", "positive") is False
    assert names_answer("it is 19", "19") is True and names_answer("it is 190", "19") is False
    assert names_answer("(a+b)", "a+b") is True  # the answer is text, not a pattern
    assert names_answer("anything", None) is None and names_answer("anything", " ") is None


def test_stats_are_the_buffer_s_view_of_the_groups() -> None:
    groups = [
        [RIGHT, WRONG, WRONG, WRONG],  # spread: trains
        [RIGHT] * 4,  # solved: flat
        [WRONG] * 4,  # stuck: flat
        [Reply(0.5, False, True), WRONG, WRONG, WRONG],  # partial credit: trains
    ]
    s = stats(groups)
    assert (s.prompts, s.k) == (4, 4)
    assert s.pass_at_1 == pytest.approx((0.25 + 1.0 + 0 + 0) / 4)
    assert s.pass_at_k == 0.5
    assert s.flat == 0.5 and s.all_correct == 0.25
    assert s.names_answer == pytest.approx(6 / 16)
    assert s.mean_reward == pytest.approx(5.5 / 16) and s.unscored == 0.0


def test_unscored_replies_are_left_out_of_the_spread_as_the_buffer_leaves_them() -> None:
    failed = Reply(0.0, False, None, error="TimeoutError: 5 s")
    s = stats([[RIGHT, RIGHT, failed], [RIGHT, failed, failed]])
    # the first group's scored replies agree (0 from a timeout is not a judgement);
    # the second has one scored reply: neither can train
    assert s.flat == 1.0 and s.unscored == pytest.approx(0.5)
    assert s.mean_reward == 1.0 and s.first_error == "TimeoutError: 5 s"
    assert s.names_answer == 1.0  # of the replies with an answer to look for
    with pytest.raises(ValueError):
        stats([])


def test_some_spread_is_something_to_learn_from() -> None:
    v = verdict(stats([[RIGHT, WRONG], [WRONG, WRONG]]), temperature=0.7)
    assert v.kind is Kind.LEARNABLE and not v.warns and v.exit_code == 0
    assert v.line.startswith("ok: 50% of groups have a reward spread")


def test_no_correct_reply_warns_and_names_what_would_help() -> None:
    v = verdict(stats([[WRONG] * 8] * 32), temperature=0.7)
    assert v.kind is Kind.UNREACHABLE and v.exit_code == EXIT_WARN == 3
    assert "no reply of 256 was correct (pass@8 0.000)" in v.line
    for helps in ("prompt_template", "system_prompt", "flywheel sft", "init-model",
                  "temperature (now 0.7)"):  # fmt: skip
        assert helps in v.line
    assert "\n" not in v.line


def test_replies_that_name_the_answer_in_another_form_say_so() -> None:
    sentence = Reply(0.0, False, True)  # "The answer is fish." where the reward wants "fish"
    v = verdict(stats([[sentence, WRONG]] * 4), temperature=1.0)
    assert v.kind is Kind.UNREACHABLE
    assert "50% of replies name the answer but the reward does not count them" in v.line


def test_a_shaped_reward_s_spread_without_a_correct_reply_is_said_as_such() -> None:
    # demo-real's base model: exact match never, brevity credit for a right word in a sentence
    near = Reply(0.15, False, True)
    v = verdict(stats([[near, WRONG], [WRONG, WRONG]]), temperature=0.7)
    assert v.kind is Kind.UNREACHABLE and v.warns
    assert "no reply of 4 was correct (pass@2 0.000); 50% of groups have a reward spread" in v.line
    assert "RL cannot reach" not in v.line


def test_pass_at_k_near_zero_is_unreachable_too() -> None:
    # one prompt of 32 solved once: 1/32 < 0.05 of prompts
    groups = [[RIGHT, *[WRONG] * 7]] + [[WRONG] * 8] * 31
    v = verdict(stats(groups), temperature=0.7)
    assert (
        v.kind is Kind.UNREACHABLE
        and "only 1 of 32 prompts had a correct reply among its 8 (pass@8 0.031)" in v.line
    )
    assert verdict(stats(groups), temperature=0.7, min_pass_at_k=0.01).kind is Kind.LEARNABLE


def test_every_group_flat_but_not_solved_warns() -> None:
    v = verdict(stats([[RIGHT] * 4, [WRONG] * 4]), temperature=0.7)
    assert v.kind is Kind.FLAT and v.warns
    assert "every group is flat" in v.line and "samples_per_prompt" in v.line


def test_solved_is_not_stuck() -> None:
    v = verdict(stats([[RIGHT] * 8] * 4), temperature=0.7)
    assert v.kind is Kind.SOLVED and v.warns
    assert "already correct" in v.line and "temperature" not in v.line


def test_a_reward_that_fails_is_said_before_anything_about_the_replies() -> None:
    failed = Reply(0.0, False, None, error="ValueError: reward bug")
    v = verdict(stats([[failed, failed, RIGHT]] * 2), temperature=0.7)
    assert v.kind is Kind.UNSCORED and "ValueError: reward bug" in v.line
    assert "[task] reward" in v.line

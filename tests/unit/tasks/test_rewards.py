"""Every built-in reward, the weighted sum, and the sandbox they run in."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from typing import Any

import pytest

from services.sandbox import VerifierPool, resolve, to_reward
from services.tasks import rewards as R
from services.tasks.reasoning_gym import reasoning_gym_score
from services.tasks.scoring import reward_payload
from services.tasks.spec import TaskSpec
from tests.harness.sandbox import TESTS

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


def payload(reward: Any, **source: Any) -> list[dict[str, Any]]:
    src = source or {"type": "arithmetic"}
    return reward_payload(TaskSpec.model_validate({"source": src, "reward": reward}))


def test_exact_match_extractions() -> None:
    assert R.exact_match("  46 \nrest", "46") == 1.0
    assert R.exact_match("4 6", "46") == 0.0
    assert R.exact_match("hello   world.", "hello world") == 1.0
    assert R.exact_match("46.", "46", normalize=False) == 0.0
    assert (
        R.exact_match(
            "think\n<answer>Paris</answer>", "paris", extract_="answer_tag", case_sensitive=False
        )
        == 1.0
    )
    assert R.exact_match("no tag", "x", extract_="answer_tag") == 0.0
    assert R.exact_match("so \\boxed{x+1}", "x+1", extract_="boxed") == 1.0
    assert R.exact_match("steps\n#### 12", "12", extract_="marker") == 1.0
    assert R.exact_match("a\nb\n\n", "b", extract_="last_line") == 1.0
    assert R.exact_match("anything", None) == 0.0


def test_numeric_match() -> None:
    assert R.numeric_match("so 3.50 in total", "7/2") == 1.0
    assert R.numeric_match("total: 1,234 apples", "1234") == 1.0
    assert R.numeric_match("12 then 13", "12") == 0.0  # the last number counts
    assert R.numeric_match("#### 42 (and 7)", "42", extract_="marker") == 1.0
    assert R.numeric_match("0.3333333", "1/3", rel_tol=1e-6) == 1.0
    assert R.numeric_match("no number", "5") == 0.0


@pytest.mark.parametrize(
    ("completion", "answer", "ok"),
    [
        ("so the result is \\boxed{\\frac{7}{2}}", "7/2", True),
        ("x = 3.5", "7/2", True),
        ("total: 1,234 apples", "1234", True),
        ("\\boxed{12}", "13", False),
        ("no number here", "5", False),
        ("Tom has 3 + 4 = 7 apples.\n#### 7", "7", True),
    ],
)
def test_math_answer_and_its_fallback(completion: str, answer: str, ok: bool) -> None:
    assert R.simple_math_equal(completion, answer) is ok
    if HAS_MATH_VERIFY:
        assert R.math_answer(completion, answer) == float(ok)
    assert R.math_answer(completion, None) == 0.0


def test_math_fallback_text_answers() -> None:
    assert R.simple_math_equal("\\boxed{x+1}", "x + 1")


def test_gsm8k() -> None:
    assert R.gsm8k_answer("3 + 4 = 7\n#### 7", "3 + 4 = 7\n#### 7") == 1.0
    assert R.gsm8k_answer("#### 1,000\nthanks", "1000") == 1.0
    assert R.gsm8k_answer("the answer is 7", "#### 7") == 0.0  # strict: needs ####
    assert R.gsm8k_answer("the answer is 7", "#### 7", strict=False) == 1.0
    assert R.gsm8k_answer("#### 8", "#### 7") == 0.0


def test_format_reward() -> None:
    assert R.format_reward("a <answer>1</answer>", pattern=r"<answer>.+?</answer>") == 1.0
    assert R.format_reward("a <answer></answer>", pattern=r"<answer>.+?</answer>") == 0.0
    assert (
        R.format_reward("<answer>1</answer> more", pattern=r"<answer>.+?</answer>", full_match=True)
        == 0.0
    )
    assert R.format_reward("x\n#### 5", pattern=r"#### -?\d+$") == 1.0


def test_soft_overlong_is_dapos_ramp() -> None:
    f = [R.soft_overlong(n, max_tokens=100, buffer_tokens=20) for n in (50, 80, 90, 100, 101)]
    assert f == [0.0, 0.0, -0.5, -1.0, -1.0]


def test_reasoning_gym_scores_with_its_own_scorer() -> None:
    rg = pytest.importorskip("reasoning_gym")
    data = rg.create_dataset("leg_counting", size=5, seed=1)
    src = {"dataset": "leg_counting", "config": {}, "seed": 1, "size": 5}
    right = reasoning_gym_score(str(data[2]["answer"]), **src, row=2)
    assert right == 1.0 and reasoning_gym_score("nope", **src, row=2) == 0.0


def test_weighted_sum_keeps_every_part() -> None:
    parts = payload(
        [
            {"fn": "gsm8k"},
            {"fn": "format", "pattern": "####", "weight": 0.1},
            {"fn": "soft_overlong", "max_tokens": 10, "buffer_tokens": 5, "weight": 2},
        ]
    )
    r = R.score(parts, "so\n#### 7", "7", {"response_tokens": 9, "row": 0})
    assert r["parts"] == {"gsm8k": 1.0, "format": 1.0, "soft_overlong": -0.8}
    assert r["reward"] == pytest.approx(1.0 + 0.1 - 1.6)
    custom = payload({"fn": "tests.unit.tasks.fixtures:shouting", "kwargs": {"bonus": 0.5}})
    c = R.score(custom, "HEY", None, {"response_tokens": 3, "row": 0})
    assert c == {"reward": 1.5, "parts": {"shouting": 1.5, "shouting.length": 3.0}}


def test_to_reward_shapes() -> None:
    assert to_reward(1).reward == 1.0
    assert to_reward((0.5, {"a": 1})).parts == {"a": 1.0}
    assert to_reward({"reward": 0.25, "parts": {"b": 2}}).reward == 0.25
    with pytest.raises(ValueError):
        to_reward(float("nan"))
    with pytest.raises(Exception, match="cannot import"):
        resolve("no_such_module_xyz:f")


def test_pool_scores_parts_and_survives_hangs_raises_and_deaths(run_async: Any) -> None:
    fx = "tests.unit.tasks.fixtures"

    async def body() -> None:
        async with VerifierPool(size=2, timeout_s=1.0, sandbox=TESTS) as pool:
            parts = payload(["exact_match"])
            t0 = time.monotonic()
            hung, *goods = await asyncio.gather(
                pool.call(R.SCORE, payload(f"{fx}:hangs"), "a", "b", {}),
                *(pool.call(R.SCORE, parts, "7", "7", {}) for _ in range(3)),
            )  # A hang beside good calls: they are not held up.
            elapsed = time.monotonic() - t0
            raised = await pool.call(R.SCORE, payload(f"{fx}:raises"), "a", "b", {})
            died = await pool.call("tests.unit.tasks.verifier_fixtures:die", "a", "b")
            after = await pool.call(R.SCORE, parts, "7", "7", {})
            assert len(pool._all) == 2  # killed children were replaced
        assert hung.reward == 0.0 and "timed out" in (hung.error or "")
        assert [(g.reward, g.parts) for g in goods] == [(1.0, {"exact_match": 1.0})] * 3
        assert elapsed < 8.0
        assert raised.reward == 0.0 and "ValueError: reward bug" in (raised.error or "")
        assert died.reward == 0.0 and "died" in (died.error or "")
        assert after.reward == 1.0
        assert pool.errors == {"timeout": 1, "raised": 1, "crashed": 1}
        # each says why it has no verdict: the dead-letter reason the worker files it under
        reasons = [r.reason for r in (hung, raised, died, after)]
        assert reasons == ["verifier_timeout", "verifier_raised", "verifier_crashed", None]

    run_async(body(), timeout_s=60)


def test_call_many_answers_as_one_call_each(run_async: Any) -> None:
    """A group in one round trip: the same rewards and errors as a call per completion,
    a raise staying with its completion; a hang in the batch reruns the calls one by
    one, so only the hung one scores 0, with the same timeout error and count."""
    fx = "tests.unit.tasks.fixtures"
    parts = payload(["exact_match"])
    mixed = payload(f"{fx}:raises_on_x")
    calls = [(parts, "7", "7", {}), (parts, "8", "7", {}), (parts, "7\nx", "7", {})]
    odd = [(mixed, "7", "7", {}), (mixed, "x", "7", {}), (mixed, "7", "7", {})]
    hangs = [(parts, "7", "7", {}), (payload(f"{fx}:hangs"), "a", "b", {})]

    async def body() -> None:
        async with VerifierPool(size=1, timeout_s=1.0, sandbox=TESTS) as pool:
            one_by_one = [await pool.call(R.SCORE, *c) for c in calls + odd]
            errors_before = dict(pool.errors)
            many = await pool.call_many(R.SCORE, calls) + await pool.call_many(R.SCORE, odd)
            assert many == one_by_one
            assert pool.errors["raised"] == 2 * errors_before["raised"] == 2
            t0 = time.monotonic()
            good, hung = await pool.call_many(R.SCORE, hangs)
            assert time.monotonic() - t0 < 8.0  # the batch's limit, then the hung call's
            assert good.reward == 1.0 and good.error is None
            assert hung.reward == 0.0 and "timed out" in (hung.error or "")
            assert pool.errors["timeout"] == 1  # the batch's own timeout is not counted
            assert await pool.call_many(R.SCORE, calls[:1]) == one_by_one[:1]

    run_async(body(), timeout_s=60)

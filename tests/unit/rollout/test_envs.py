"""Environments, verifiers and the killable verifier sandbox."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest

from services.common.arithmetic import problem as arith_problem
from services.common.errors import ConfigError
from services.rollout.envs import Problem, VerifierPool, make_env, score
from services.rollout.envs.builtin import CalcError, CalculatorEnv, calculate, calculator_reward
from services.rollout.envs.sandbox import resolve, to_reward
from services.rollout.envs.verifiers import exact_match, math_answer, simple_math_equal


def test_exact_match_normalises_whitespace_and_uses_the_first_line() -> None:
    assert exact_match("  46 \nrest", "46") == 1.0
    assert exact_match("4 6", "46") == 0.0
    assert exact_match("hello   world.", "hello world") == 1.0


@pytest.mark.parametrize(
    "completion, answer, ok",
    [
        ("so the result is \\boxed{\\frac{7}{2}}", "7/2", True),
        ("x = 3.5", "7/2", True),
        ("total: 1,234 apples", "1234", True),
        ("\\boxed{12}", "13", False),
        ("no number here", "5", False),
        ("\\boxed{x+1}", "x + 1", True),
    ],
)
def test_simple_math_normaliser(completion: str, answer: str, ok: bool) -> None:
    assert simple_math_equal(completion, answer) is ok
    if importlib.util.find_spec("math_verify") is None:  # the fallback is what math_answer uses
        assert math_answer(completion, answer) == float(ok)


def test_calculator_is_safe_and_correct() -> None:
    assert calculate("(12+3)*4 - 10//3") == 57
    for bad in ("__import__('os')", "2**100", "1/0", "9" * 20, "a+1"):
        with pytest.raises(CalcError):
            calculate(bad)


def test_calculator_env_steps() -> None:
    env = CalculatorEnv(seed=1, digits=2, max_turns=3)
    p = env.problem(0)
    ref = arith_problem(1, 0, 2)
    assert p.answer == ref.answer and ref.prompt.rstrip("=") in (p.prompt or "")
    state = env.initial_state(p)
    t1 = env.step(state, "let me <calc>2*(3+4)</calc>")
    assert t1.observation == "<result>14</result>\n" and not t1.done
    t2 = env.step(t1.state, "<calc>1/0</calc>")
    assert t2.observation is not None and "error" in t2.observation and not t2.done
    t3 = env.step(t2.state, f"<answer>{p.answer}</answer>")
    assert t3.done and t3.state.turns == 3
    assert env.step(state, "no tool call").done  # no call, no answer: episode over
    r = to_reward(calculator_reward(t3.state.transcript, p.answer or ""))
    assert r.reward == 1.0 and r.parts == {"tool_calls": 2.0}


def test_jsonl_env(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+1=", "answer": 2})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": "x"})
        + "\n"
    )
    env = make_env("jsonl", path=data, verifier="math")
    assert len(env) == 2  # type: ignore[arg-type]
    assert env.problem(0) == Problem(prompt="1+1=", answer="2")
    assert env.problem(3).messages == ({"role": "user", "content": "hi"},)  # wraps around
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "answer": "1"}\n{"answer": "no prompt"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        make_env("jsonl", path=bad)


def test_make_env_errors() -> None:
    with pytest.raises(ConfigError, match="unknown environment"):
        make_env("nope")
    with pytest.raises(ConfigError, match="bad options"):
        make_env("arithmetic", colour="red")
    with pytest.raises(ConfigError, match=r"pkg\.module:function"):
        make_env("arithmetic", verifier="not-a-path")
    with pytest.raises(ConfigError, match="cannot import"):
        resolve("no_such_module_xyz:f")
    if importlib.util.find_spec("reasoning_gym") is None:
        with pytest.raises(ConfigError, match="reasoning-gym"):
            make_env("reasoning_gym:basic_arithmetic")


def test_to_reward_shapes() -> None:
    assert to_reward(1).reward == 1.0
    assert to_reward((0.5, {"a": 1})).parts == {"a": 1.0}
    assert to_reward({"reward": 0.25, "parts": {"b": 2}}).reward == 0.25
    with pytest.raises(ValueError):
        to_reward(float("nan"))


def test_pool_scores_builtin_and_custom_verifiers(run_async: Any) -> None:
    async def body() -> None:
        env = make_env("arithmetic", seed=0)
        p = env.problem(5)
        async with VerifierPool(size=1, timeout_s=10) as pool:
            good = await score(pool, env, p, f"{p.answer}\n")
            bad = await score(pool, env, p, "nonsense")
            custom = make_env(
                "arithmetic", verifier="tests.unit.rollout.verifier_fixtures:length_reward"
            )
            parts = await score(pool, custom, p, "x" * len(p.answer or ""))
        assert (good.reward, good.error) == (1.0, None)
        assert bad.reward == 0.0 and bad.error is None
        assert parts.reward == 1.0 and parts.parts == {"length": float(len(p.answer or ""))}
        assert pool.errors.total() == 0 and pool.calls == 3

    run_async(body())


def test_hanging_raising_and_dying_verifiers_score_zero_and_the_pool_carries_on(
    run_async: Any,
) -> None:
    async def body() -> None:
        async with VerifierPool(size=2, timeout_s=1.0) as pool:
            t0 = time.monotonic()
            # A hang and good calls at the same time: the good ones are not held up.
            hung, *goods = await asyncio.gather(
                pool.call("tests.unit.rollout.verifier_fixtures:hang", "a", "b"),
                *(pool.call("services.rollout.envs.verifiers:exact_match", "7", "7")
                  for _ in range(3)),
            )  # fmt: skip
            elapsed = time.monotonic() - t0
            raised = await pool.call("tests.unit.rollout.verifier_fixtures:boom", "a", "b")
            died = await pool.call("tests.unit.rollout.verifier_fixtures:die", "a", "b")
            after = await pool.call("services.rollout.envs.verifiers:exact_match", "7", "7")
            assert len(pool._all) == 2  # killed children were replaced
        assert hung.reward == 0.0 and hung.error is not None and "timed out" in hung.error
        assert [g.reward for g in goods] == [1.0, 1.0, 1.0]
        assert elapsed < 8.0
        assert raised.reward == 0.0 and "ValueError: verifier bug" in (raised.error or "")
        assert died.reward == 0.0 and "died" in (died.error or "")
        assert after.reward == 1.0
        assert pool.errors == {"timeout": 1, "raised": 1, "crashed": 1}

    run_async(body(), timeout_s=60)

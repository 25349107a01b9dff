"""The multi-turn calculator environment (single-turn tasks: tests/unit/tasks)."""

from __future__ import annotations

import pytest

from services.common.arithmetic import problem as arith_problem
from services.common.tasks.sandbox import to_reward
from services.rollout.envs.calculator import CalcError, CalculatorEnv, calculate, calculator_reward


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

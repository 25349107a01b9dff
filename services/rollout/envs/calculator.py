"""A multi-turn environment with a tool: the policy calls a calculator, then answers.

Single-turn tasks (JSONL, datasets, reasoning-gym, arithmetic) are not
environments here: they are the run file's task spec (services/common/tasks).
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from services.common import arithmetic
from services.rollout.envs.base import Problem, Turn

# ---- calculator tool use (multi-turn) ----------------------------------------------------

_CALC = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_BINOPS: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalcError(ValueError):
    """An expression the calculator refuses (syntax, operator, size)."""


def calculate(expr: str, limit: int = 10**12) -> int:
    """Evaluate integer + - * // % with parentheses, safely (an AST walk, never eval)."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"bad expression: {expr!r}") from e

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = -ev(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
                raise CalcError("division by zero")
            value = _BINOPS[type(node.op)](left, right)
        else:
            raise CalcError(f"unsupported expression: {expr!r}")
        if abs(value) > limit:
            raise CalcError("number too large")
        return int(value)

    return ev(tree)


@dataclass(frozen=True)
class CalcState:
    turns: int = 0
    transcript: str = ""


class CalculatorEnv:
    """Multi-turn: the policy may write <calc>expr</calc> and gets <result>v</result> back.

    A turn ends at "</calc>" or "</answer>" (stop strings). After a calc
    call the environment appends the result (loss mask 0) and the policy
    goes on; a turn with an <answer>…</answer> or without a calc call ends
    the episode, as does `max_turns`. Reward: the final answer equals the
    reference sum.
    """

    name = "calculator"
    multi_turn: ClassVar[bool] = True
    stop = ("</calc>", "</answer>")
    verifier = "services.rollout.envs.calculator:calculator_reward"

    def __init__(self, seed: int = 0, digits: int = 3, max_turns: int = 4) -> None:
        self.seed, self.digits, self.max_turns = seed, digits, max_turns

    def problem(self, index: int) -> Problem:
        p = arithmetic.problem(self.seed, index, self.digits)
        prompt = (
            "Use <calc>expression</calc> to compute, then reply <answer>number</answer>.\n"
            f"What is {p.prompt.rstrip('=')}?\n"
        )
        return Problem(prompt=prompt, answer=p.answer)

    def initial_state(self, problem: Problem) -> CalcState:
        return CalcState()

    def step(self, state: CalcState, turn_text: str) -> Turn:
        state = replace(state, turns=state.turns + 1, transcript=state.transcript + turn_text)
        calls = _CALC.findall(turn_text)
        if _ANSWER.search(turn_text) or not calls or state.turns >= self.max_turns:
            return Turn(state, None, True)
        try:
            result = str(calculate(calls[-1]))
        except CalcError as e:
            result = f"error: {e}"
        return Turn(state, f"<result>{result}</result>\n", False)

    def verifier_args(self, completion: str, problem: Problem) -> tuple[Any, ...]:
        return (completion, problem.answer or "")


def calculator_reward(transcript: str, answer: str) -> dict[str, Any]:
    """1 if the last <answer> equals the reference; part "tool_calls" counts calc calls."""
    answers = _ANSWER.findall(transcript)
    correct = bool(answers) and answers[-1].strip() == answer.strip()
    return {
        "reward": 1.0 if correct else 0.0,
        "parts": {"tool_calls": float(len(_CALC.findall(transcript)))},
    }

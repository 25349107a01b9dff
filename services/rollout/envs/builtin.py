"""The built-in environments: arithmetic, JSONL datasets, a calculator tool, reasoning-gym."""

from __future__ import annotations

import ast
import functools
import json
import operator
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from services.common import arithmetic
from services.common.errors import ConfigError
from services.rollout.envs import verifiers
from services.rollout.envs.base import Problem, SingleTurn, Turn

VERIFIER_ALIASES = {"exact": verifiers.EXACT, "math": verifiers.MATH}


def verifier_path(name: str) -> str:
    """ "exact" / "math" or a custom "pkg.module:function"."""
    path = VERIFIER_ALIASES.get(name, name)
    if ":" not in path:
        raise ConfigError(f"verifier {name!r}: use 'exact', 'math' or 'pkg.module:function'")
    return path


class ArithmeticEnv(SingleTurn):
    """The demo task: "a+b=" -> the sum (services.common.arithmetic), procedural and seeded."""

    name = "arithmetic"

    def __init__(self, seed: int = 0, digits: int = 2, verifier: str | None = None) -> None:
        self.seed, self.digits = seed, digits
        self.verifier = verifier_path(verifier) if verifier else verifiers.ARITHMETIC

    def problem(self, index: int) -> Problem:
        p = arithmetic.problem(self.seed, index, self.digits)
        return Problem(prompt=p.prompt, answer=p.answer)


class JsonlEnv(SingleTurn):
    """A JSONL dataset: {"prompt": str, "answer": str} or {"messages": [...], "answer": str}."""

    name = "jsonl"

    def __init__(self, path: str | Path, verifier: str = "exact") -> None:
        self.path = Path(path)
        self.verifier = verifier_path(verifier)
        self.problems = load_jsonl(self.path)
        if not self.problems:
            raise ConfigError(f"{self.path}: no problems")

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, index: int) -> Problem:
        return self.problems[index % len(self.problems)]


def load_jsonl(path: Path) -> list[Problem]:
    """Parse a prompt dataset; ConfigError names the file and line of a bad record."""
    out: list[Problem] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read dataset {path}: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: not JSON: {e}") from e
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{lineno}: a record must be an object")
        answer = rec.get("answer")
        answer = None if answer is None else str(answer)
        if isinstance(rec.get("prompt"), str):
            out.append(Problem(prompt=rec["prompt"], answer=answer))
        elif isinstance(rec.get("messages"), list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in rec["messages"]
        ):
            msgs = tuple({"role": str(m.get("role", "user")), "content": m["content"]}
                         for m in rec["messages"])  # fmt: skip
            out.append(Problem(messages=msgs, answer=answer))
        else:
            raise ConfigError(f"{path}:{lineno}: needs 'prompt' (string) or 'messages' (list)")
    return out


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
    verifier = "services.rollout.envs.builtin:calculator_reward"

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
    return {"reward": 1.0 if correct else 0.0,
            "parts": {"tool_calls": float(len(_CALC.findall(transcript)))}}  # fmt: skip


# ---- reasoning-gym (optional) -------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _rg_dataset(task: str, seed: int, size: int) -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(
            "reasoning-gym environments need the 'reasoning-gym' package "
            "(pip install reasoning-gym)"
        ) from e
    return reasoning_gym.create_dataset(task, seed=seed, size=size)


class ReasoningGymEnv(SingleTurn):
    """A reasoning-gym procedural task; scored by the task's own `score_answer`."""

    verifier = "services.rollout.envs.builtin:reasoning_gym_score"

    def __init__(self, task: str, seed: int = 0, size: int = 10_000) -> None:
        self.task, self.seed, self.size = task, seed, size
        self.name = f"reasoning_gym:{task}"
        self.dataset = _rg_dataset(task, seed, size)

    def problem(self, index: int) -> Problem:
        i = index % self.size
        entry = self.dataset[i]
        return Problem(prompt=entry["question"], answer=str(entry["answer"]), info={"index": i})

    def verifier_args(self, completion: str, problem: Problem) -> tuple[Any, ...]:
        return (self.task, self.seed, self.size, problem.info["index"], completion)


def reasoning_gym_score(task: str, seed: int, size: int, index: int, completion: str) -> float:
    dataset = _rg_dataset(task, seed, size)
    return float(dataset.score_answer(answer=completion.strip(), entry=dataset[index]))

"""Tools of multi-turn episodes: parse a turn's call, run it in the sandbox, format the result.

Parsing and formatting are pure and run in the rollout worker (and the
evaluation); `call` runs in the tool sandbox (`ToolPool`, services/sandbox/pool.py: a
process forked per call inside bubblewrap's walls, services/sandbox/jail.py), so a tool that
hangs, raises, eats memory, exits or tries to reach out costs only its turn.

`call` takes the tool's spec as a plain dict (what crosses the pipe is
MessagePack, never pickle) and returns the observation text.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import operator
import re
from dataclasses import dataclass
from typing import Any

from services.sandbox import every_child_imports, text_reader, tool_warmup
from services.tasks.episode_spec import EpisodeSpec, FunctionTool

CALL = "services.tasks.tools:call"
WARM = "services.tasks.tools:warm"


@dataclass(frozen=True)
class ToolCall:
    tag: str
    body: str


def call_pattern(spec: EpisodeSpec) -> re.Pattern[str]:
    tags = "|".join(re.escape(t.tag) for t in spec.tools)
    return re.compile(rf"<({tags})>(.*?)</\1>", re.S)


def parse_turn(spec: EpisodeSpec, text: str) -> ToolCall | None:
    """The tool call that ended this turn, or None: an answer, or no call (the episode ends).

    Only a call closing the turn counts (the engine stops at the closing
    tag); a turn that answers ends the episode even if it also called.
    """
    if f"</{spec.answer_tag}>" in text:
        return None
    calls = call_pattern(spec).findall(text)
    if not calls or not text.rstrip().endswith(f"</{calls[-1][0]}>"):
        return None
    tag, body = calls[-1]
    return ToolCall(tag, body.strip())


def observation(spec: EpisodeSpec, result: str, error: bool) -> str:
    """The text appended after a call (cut to max_observation_chars)."""
    if len(result) > spec.max_observation_chars:
        result = result[: spec.max_observation_chars] + "…"
    template = spec.error_template if error else spec.result_template
    return template.replace("{result}", result)


def count_calls(spec: EpisodeSpec, text: str) -> int:
    return len(call_pattern(spec).findall(text))


# ── the tools (run in a sandbox child) ───────────────────────────────────────
class ToolError(ValueError):
    """A call the tool refuses: its message becomes the error observation."""


_BINOPS: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expr: str, limit: int = 10**12) -> int:
    """Evaluate integer + - * // % with parentheses, safely (an AST walk, never eval)."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"bad expression: {expr!r}") from e

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
                raise ToolError("division by zero")
            value = _BINOPS[type(node.op)](left, right)
        else:
            raise ToolError(f"unsupported expression: {expr!r}")
        if abs(value) > limit:
            raise ToolError("number too large")
        return int(value)

    return ev(tree)


def run_python(code: str) -> str:
    """Run `code` in a fresh namespace; what it printed, else the value of a last expression."""
    tree = ast.parse(code, mode="exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    namespace: dict[str, Any] = {"__name__": "__tool__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "<tool>", "exec"), namespace)  # the sandbox is the limit
        value = eval(compile(last, "<tool>", "eval"), namespace) if last else None
    printed = out.getvalue()
    return printed if printed or value is None else repr(value)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def check_arguments(tool: FunctionTool, body: str) -> dict[str, Any]:
    """The call's JSON arguments, checked against the tool's parameters (ToolError if not)."""
    try:
        args = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError as e:
        raise ToolError(f"arguments are not JSON: {e}") from e
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    missing = [r for r in tool.required if r not in args]
    unknown = [k for k in args if k not in tool.parameters]
    if missing or unknown:
        raise ToolError(f"missing arguments {missing}, unknown arguments {unknown}")
    for k, v in args.items():
        want = tool.parameters[k].type
        is_bool = isinstance(v, bool)
        if not isinstance(v, _JSON_TYPES[want]) or (is_bool and want != "boolean"):
            raise ToolError(f"argument {k!r} must be {want}, got {type(v).__name__}")
    return args


def call(tool: dict[str, Any], body: str) -> str:
    """Run one call of `tool` (its spec as a dict) in this sandbox child."""
    from services.sandbox import environment, resolve

    kind = tool["type"]
    if kind == "calculator":
        return str(calculate(body, tool["limit"]))
    if kind == "python":
        return run_python(body)
    spec = FunctionTool.model_validate(tool)
    with environment(spec.env):
        result = resolve(spec.fn)(**check_arguments(spec, body))
    return result if isinstance(result, str) else json.dumps(result)


def pure(tool: Any) -> bool:
    """The calculator: an AST walk of integers, never eval; answered without a fork."""
    return isinstance(tool, dict) and tool.get("type") == "calculator"


# What the sandbox runs of this module: every child imports it before it serves, every
# tool pool's children run `warm` first, and the calculator needs no process of its own.
every_child_imports(__name__)
tool_warmup(WARM)
text_reader(CALL, "value", pure)


def warm(tools: list[dict[str, Any]]) -> float:
    """Run by every new tool child before it serves: import this module's dependencies
    and the user's tool functions, so a call's time limit is spent calling."""
    from services.sandbox import resolve

    for tool in tools:
        if tool["type"] == "function":
            resolve(tool["fn"])
    return 1.0

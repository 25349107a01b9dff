"""Episode specs and tools: parsing a turn, the calculator, argument checks, bad configs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.runtime.errors import ConfigError
from services.tasks.episode_spec import EpisodeSpec, FunctionTool
from services.tasks.spec import TaskSpec
from services.tasks.taskset import check
from services.tasks.tools import (
    ToolCall,
    ToolError,
    calculate,
    call,
    check_arguments,
    observation,
    parse_turn,
    run_python,
)

FN = "tests.unit.tasks.tool_fixtures"


def spec(**kw: object) -> EpisodeSpec:
    tools = [{"type": "calculator"}, {"type": "python"}]
    return EpisodeSpec.model_validate({"tools": tools, **kw})


def test_parse_turn() -> None:
    s = spec()
    assert s.stop == ("</calc>", "</python>", "</answer>")
    assert parse_turn(s, "so <calc> 12*3 </calc>") == ToolCall("calc", "12*3")
    assert parse_turn(s, "<python>print(1)</python>") == ToolCall("python", "print(1)")
    # an answer ends the episode; so does a turn that ends without closing a call
    assert parse_turn(s, "<calc>1+1</calc><answer>2</answer>") is None
    assert parse_turn(s, "no call at all") is None
    assert parse_turn(s, "<calc>1+1</calc> and then rambling") is None
    assert parse_turn(s, "<calc>1+1") is None  # cut by the length limit


def test_observation_templates_and_cut() -> None:
    s = spec(max_observation_chars=4)
    assert observation(s, "42", error=False) == "<result>42</result>\n"
    assert observation(s, "123456", error=True) == "<result>error: 1234…</result>\n"


def test_calculator_is_safe_and_correct() -> None:
    assert calculate("(12+3)*4 - 10//3") == 57
    for bad in ("__import__('os')", "2**100", "1/0", "9" * 20, "a+1"):
        with pytest.raises(ToolError):
            calculate(bad)
    assert call({"type": "calculator", "limit": 10**12}, "123*456") == "56088"


def test_python_tool_prints_or_returns() -> None:
    assert run_python("print(6*7)") == "42\n"
    assert run_python("x = 3\nx * 2") == "6"
    assert run_python("x = 3") == ""


def test_function_tool_arguments_are_checked() -> None:
    tool = FunctionTool.model_validate(
        {
            "type": "function",
            "tag": "add",
            "fn": f"{FN}:add",
            "parameters": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        }
    )
    assert tool.required == ("a", "b")
    assert check_arguments(tool, '{"a": 1, "b": 2}') == {"a": 1, "b": 2}
    for bad, why in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"a": 1}', "missing"),
        ('{"a": 1, "b": 2, "c": 3}', "unknown"),
        ('{"a": "1", "b": 2}', "must be integer"),
        ('{"a": true, "b": 2}', "must be integer"),
    ]:
        with pytest.raises(ToolError, match=why):
            check_arguments(tool, bad)
    assert call(tool.model_dump(mode="json"), '{"a": 1, "b": 2}') == "3"


def test_bad_episode_config_names_the_key() -> None:
    base = {"source": {"type": "arithmetic"}}
    bad = [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "shell"}]}, "tools.0"),
        ({"tools": [{"type": "calculator", "tag": "answer"}]}, "tags"),
        ({"tools": [{"type": "calculator"}], "max_turns": 0}, "max_turns"),
        ({"tools": [{"type": "calculator"}], "result_template": "{x}"}, "result_template"),
        ({"tools": [{"type": "calculator"}], "tool_timeout_s": 0}, "tool_timeout_s"),
        ({"tools": [{"type": "function", "tag": "f", "fn": "nocolon"}]}, "fn"),
        (
            {"tools": [{"type": "function", "tag": "f", "fn": "a:b", "required": ["x"]}]},
            "required",
        ),
    ]
    for episode, key in bad:
        with pytest.raises(ValidationError, match=key):
            TaskSpec.model_validate({**base, "episode": episode})


def test_user_tool_checked_at_start_up() -> None:
    def task(tool: dict[str, object]) -> TaskSpec:
        ep = {"tools": [{"type": "function", "tag": "t", **tool}]}
        return TaskSpec.model_validate({"source": {"type": "arithmetic"}, "episode": ep})

    ok = {"fn": f"{FN}:add", "parameters": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    check("t", task(ok), "[task]", data=False)
    with pytest.raises(ConfigError, match=r"\[task\] episode.tools\[0\].fn: cannot import"):
        check("t", task({"fn": f"{FN}:missing"}), "[task]", data=False)
    wrong = {"fn": f"{FN}:add", "parameters": {"a": {"type": "integer"}}}
    with pytest.raises(ConfigError, match=r"episode.tools\[0\].parameters: .* does not take"):
        check("t", task(wrong), "[task]", data=False)

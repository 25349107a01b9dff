"""The `[task.episode]` table: a multi-turn episode with tools, typed.

A task with an episode is rolled out as turns: the policy generates until
it closes a tool call (`</calc>`) or an answer (`</answer>`); a tool call
runs in the tool sandbox and its result is appended as an observation the
policy did not write (loss mask 0); then the policy goes on, up to
`max_turns` turns and `max_tokens` response tokens in all.

The syntax of a call is one tag per tool, `<tag>body</tag>`: short enough
for a tiny model to learn, and parseable with one regular expression, so
the turn's end is a plain stop string the engine (SGLang or the CPU one)
already honours. A function tool's body is a JSON object of its arguments,
checked against its declared `parameters` before the function runs.

Pure validation here, like spec.py: importing a user tool is the start-up
check in services.tasks.sources.
"""

from __future__ import annotations

import keyword
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_FN_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
_TAG = r"^[A-Za-z][A-Za-z0-9_-]{0,31}$"
JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Tool(_Strict):
    tag: str = Field(pattern=_TAG, description="The call is <tag>body</tag>.")
    description: str = Field("", description="What the tool does (shown in docs and prompts).")


class CalculatorTool(_Tool):
    """Integer arithmetic: + - * // % and parentheses (an AST walk, never eval)."""

    type: Literal["calculator"]
    tag: str = Field("calc", pattern=_TAG, description="The call is <tag>expression</tag>.")
    limit: int = Field(10**12, ge=1, description="Refuse results larger than this in magnitude.")


class PythonTool(_Tool):
    """Python code run in the tool sandbox; the observation is what it printed
    (or the value of a last expression). No network, nothing writable but a
    private /tmp, the sandbox's memory, process and time limits; each call runs
    in a fresh process forked from a warm one, so no call sees another's state."""

    type: Literal["python"]
    tag: str = Field("python", pattern=_TAG, description="The call is <tag>code</tag>.")


class Parameter(_Strict):
    """One argument of a function tool (JSON-schema-like)."""

    type: Literal["string", "integer", "number", "boolean", "array", "object"] = Field(
        description="JSON type of the argument."
    )
    description: str = Field("", description="What the argument means.")


class FunctionTool(_Tool):
    """A user function `pkg.module:function(**arguments)`; the body of a call is a JSON
    object of its arguments, checked against `parameters` before it runs."""

    type: Literal["function"]
    fn: str = Field(pattern=_FN_PATH, description="'pkg.module:function' returning the result.")
    parameters: dict[str, Parameter] = Field(
        default_factory=dict, description="Arguments by name: {type, description}."
    )
    required: tuple[str, ...] = Field(
        (), description="Arguments a call must give (default: every parameter)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables the function sees; the sandbox's environment is "
        "otherwise empty (never the service's: it holds credentials).",
    )

    @field_validator("parameters")
    @classmethod
    def _names(cls, v: dict[str, Parameter]) -> dict[str, Parameter]:
        bad = [k for k in v if not k.isidentifier() or keyword.iskeyword(k)]
        if bad:
            raise ValueError(f"parameter names must be Python identifiers, got {bad}")
        return v

    @model_validator(mode="after")
    def _required_known(self) -> FunctionTool:
        unknown = [r for r in self.required if r not in self.parameters]
        if unknown:
            raise ValueError(f"required names unknown parameters {unknown}")
        if not self.required:
            object.__setattr__(self, "required", tuple(self.parameters))
        return self


ToolSpec = Annotated[CalculatorTool | PythonTool | FunctionTool, Field(discriminator="type")]


class EpisodeSpec(_Strict):
    """A multi-turn episode with tools (`[task.episode]`)."""

    tools: tuple[ToolSpec, ...] = Field(
        min_length=1, description="The tools the policy may call: [{type = 'calculator'}, ...]."
    )
    max_turns: int = Field(4, ge=1, le=64, description="Policy turns per episode at most.")
    max_tokens: int = Field(
        512,
        ge=1,
        description="Response tokens per episode at most, observations included; each turn "
        "also stops at the task's max_new_tokens.",
    )
    answer_tag: str = Field(
        "answer", pattern=_TAG, description="<answer>…</answer> ends the episode."
    )
    result_template: str = Field(
        "<result>{result}</result>\n",
        description="How an observation is appended; {result} is the tool's output.",
    )
    error_template: str = Field(
        "<result>error: {result}</result>\n",
        description="How a failed call is appended; {result} says why.",
    )
    max_observation_chars: int = Field(
        512, ge=1, description="Longer tool outputs are cut to this many characters."
    )
    tool_timeout_s: float = Field(
        5.0, gt=0, description="Limit of one tool call; a hang costs the turn an error."
    )
    tool_memory_mb: int = Field(
        1024, ge=64, description="Address-space limit of each tool sandbox process (RLIMIT_AS)."
    )
    tool_processes: int = Field(
        2, ge=1, le=64, description="Tool sandbox processes per rollout worker."
    )

    @field_validator("result_template", "error_template")
    @classmethod
    def _has_result(cls, v: str) -> str:
        if "{result}" not in v or v.replace("{result}", "").count("{") > 0:
            raise ValueError("must contain {result} and no other field")
        return v

    @model_validator(mode="after")
    def _tags_differ(self) -> EpisodeSpec:
        tags = [t.tag for t in self.tools] + [self.answer_tag]
        if len(set(tags)) != len(tags):
            raise ValueError(f"tool tags and answer_tag must differ, got {tags}")
        return self

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings that end one policy turn: every closing tag."""
        return (*(f"</{t.tag}>" for t in self.tools), f"</{self.answer_tag}>")

    def tool(self, tag: str) -> Any:
        return next(t for t in self.tools if t.tag == tag)

"""The task spec: the `[task]` table (or `[tasks.<name>]` tables) of a run file, typed.

One spec, validated the same way by every service at start-up: the buffer
reads its `source` (what to prompt with), the rollout worker its `reward`
(how to score), the trainer and `flywheel eval` its `eval` (what to hold out
and how to measure). A PromptTask names its task (`env` on the wire) and
the row of that task's source, so each service resolves the rest from its
own copy of the same file and nothing but a name travels.

Everything here is pure validation: no file is opened and nothing heavy is
imported. Checks that need the disk or an optional package (a file exists,
math-verify is installed, a custom function imports) are `check()` in
services.common.tasks.sources, run by each service before it starts work.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from services.common.tasks.episode_spec import EpisodeSpec

_FN_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
_ENV_ID = r"^([\w.-]+/)?[A-Za-z_][\w.-]*$"  # verifiers: 'owner/my-env' imports my_env


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ── sources ──────────────────────────────────────────────────────────────────
class _Fields(_Strict):
    """Which fields of a record hold the prompt and the answer."""

    prompt_field: str = Field(
        "prompt", description="Field holding the prompt text (e.g. 'question', 'problem')."
    )
    messages_field: str = Field(
        "messages", description="Field holding chat messages [{role, content}] (used if present)."
    )
    answer_field: str = Field(
        "answer", description="Field holding the reference answer (e.g. 'solution')."
    )
    answer_marker: str | None = Field(
        None,
        description="Keep only the answer's text after the last occurrence of this marker "
        "(GSM8K: '####'); the full text stays the SFT target of `flywheel init-model`.",
    )


class JsonlSource(_Fields):
    """A local JSONL file, one record per line."""

    type: Literal["jsonl"]
    path: Path = Field(description="The JSONL file (relative paths: from the working directory).")


class HfSource(_Fields):
    """A local Hugging Face `datasets` directory or a Parquet/Arrow/JSON/CSV file.

    Needs the `datasets` package (extra: datasets).
    """

    type: Literal["hf"]
    path: Path = Field(
        description="A directory written by Dataset.save_to_disk, or a .parquet/.arrow/"
        ".json/.jsonl/.csv file. Nothing is downloaded."
    )
    split: str = Field("train", description="Split to read when the data has several.")


class ReasoningGymSource(_Strict):
    """A reasoning-gym generator (extra: reasoning); procedural, nothing is downloaded."""

    type: Literal["reasoning_gym"]
    dataset: str = Field(description="Generator name, e.g. 'basic_arithmetic', 'leg_counting'.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The generator's own options (its *Config fields)."
    )
    size: int = Field(10_000, ge=1, description="Number of distinct problems.")
    seed: int = Field(0, description="Seed of the generator.")


class FunctionSource(_Fields):
    """Rows from a user function `pkg.module:function(**kwargs)` returning an iterable of dicts."""

    type: Literal["function"]
    fn: str = Field(pattern=_FN_PATH, description="'pkg.module:function' returning rows.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of fn.")


class ArithmeticSource(_Strict):
    """The built-in arithmetic task ('a+b=' -> the sum), procedural and seeded."""

    type: Literal["arithmetic"]
    size: int = Field(100_000, ge=1, description="Number of distinct problems.")
    seed: int = Field(0, description="Seed of the problems.")
    digits: int = Field(2, ge=1, le=9, description="Operand digits.")
    op: Literal["+", "*"] = Field(
        "+", description="'+': addition; '*': multiplication (the tool-use demo)."
    )


class VerifiersSource(_Strict):
    """A `verifiers` environment's dataset (extra: verifiers); its rubric scores by default."""

    type: Literal["verifiers"]
    env: str = Field(pattern=_ENV_ID, description="Its id as vf-eval takes it ('my-env').")
    args: dict[str, Any] = Field(default_factory=dict, description="load_environment's kwargs.")
    split: Literal["train", "eval"] = Field("train", description="dataset or eval_dataset.")


SourceSpec = Annotated[
    JsonlSource
    | HfSource
    | ReasoningGymSource
    | FunctionSource
    | ArithmeticSource
    | VerifiersSource,
    Field(discriminator="type"),
]

# ── rewards ──────────────────────────────────────────────────────────────────
Extract = Literal["first_line", "last_line", "full", "answer_tag", "boxed", "marker", "last_number"]


class _Part(_Strict):
    weight: float = Field(1.0, description="Weight of this part in the reward (a weighted sum).")
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name in reward_parts and the trainer's logs (default: fn).",
    )

    @property
    def part_name(self) -> str:
        return self.name or str(getattr(self, "fn", "")).rpartition(":")[2]


class ExactMatch(_Part):
    """1 if the extracted answer equals the reference (after normalisation)."""

    fn: Literal["exact_match"]
    extract: Extract = Field("first_line", description="Which part of the completion to compare.")
    marker: str = Field("####", description="extract = 'marker': text after its last occurrence.")
    normalize: bool = Field(
        True, description="Collapse whitespace, drop surrounding $ and a trailing period."
    )
    case_sensitive: bool = Field(True, description="Compare case-sensitively.")


class NumericMatch(_Part):
    """1 if the extracted number equals the reference number (exact for integers/fractions)."""

    fn: Literal["numeric"]
    extract: Extract = Field("last_number", description="Which part of the completion to parse.")
    marker: str = Field("####", description="extract = 'marker': text after its last occurrence.")
    rel_tol: float = Field(1e-6, ge=0, description="Relative tolerance for non-exact numbers.")


class MathAnswer(_Part):
    """math-verify's parse + verify (LaTeX, \\boxed{}, plain numbers), or the built-in fallback."""

    fn: Literal["math"]
    fallback: bool = Field(
        True,
        description="Without math-verify installed, use the built-in normaliser (last \\boxed{} "
        "or number); false: refuse to start without math-verify.",
    )


class Gsm8kAnswer(_Part):
    """GSM8K: the number after the completion's last '####' equals the reference's."""

    fn: Literal["gsm8k"]
    strict: bool = Field(
        True, description="Require '#### n' in the completion; false: fall back to its last number."
    )


class FormatReward(_Part):
    """1 if the completion matches a regular expression (an answer tag present, well-formed)."""

    fn: Literal["format"]
    pattern: str = Field(
        r"<answer>.+?</answer>", description="Python regular expression searched for."
    )
    full_match: bool = Field(False, description="The whole completion must match, not a part.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from e
        return v


class SoftOverlong(_Part):
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then down to -1 at max."""

    fn: Literal["soft_overlong"]
    max_tokens: int = Field(ge=1, description="L_max: responses this long or longer score -1.")
    buffer_tokens: int = Field(ge=1, description="L_cache: the length of the linear ramp.")

    @model_validator(mode="after")
    def _buffer_fits(self) -> SoftOverlong:
        if self.buffer_tokens > self.max_tokens:
            raise ValueError("buffer_tokens must be <= max_tokens")
        return self


class ReasoningGymScore(_Part):
    """The reasoning-gym generator's own `score_answer` (source type 'reasoning_gym')."""

    fn: Literal["reasoning_gym"]


class VerifiersRubric(_Part):
    """The `verifiers` environment's own rubric (source type 'verifiers')."""

    fn: Literal["verifiers"]


class CustomReward(_Part):
    """A user function `fn(completion, answer, **kwargs)` -> float | (float, parts) | dict."""

    fn: str = Field(pattern=_FN_PATH, description="'pkg.module:function'.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of fn.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables fn sees; the sandbox's environment is otherwise "
        "empty (never the service's: it holds credentials).",
    )


BUILTIN_REWARDS = (
    "exact_match",
    "numeric",
    "math",
    "gsm8k",
    "format",
    "soft_overlong",
    "reasoning_gym",
    "verifiers",
)


def _reward_tag(v: Any) -> str:
    fn = v.get("fn", "") if isinstance(v, dict) else getattr(v, "fn", "")
    return "custom" if isinstance(fn, str) and ":" in fn else str(fn)


RewardPart = Annotated[
    Annotated[ExactMatch, Tag("exact_match")]
    | Annotated[NumericMatch, Tag("numeric")]
    | Annotated[MathAnswer, Tag("math")]
    | Annotated[Gsm8kAnswer, Tag("gsm8k")]
    | Annotated[FormatReward, Tag("format")]
    | Annotated[SoftOverlong, Tag("soft_overlong")]
    | Annotated[ReasoningGymScore, Tag("reasoning_gym")]
    | Annotated[VerifiersRubric, Tag("verifiers")]
    | Annotated[CustomReward, Tag("custom")],
    Discriminator(
        _reward_tag,
        custom_error_type="unknown_reward",
        custom_error_message=f"fn must be one of {', '.join(BUILTIN_REWARDS)} "
        "or 'pkg.module:function'",
    ),
]


# ── evaluation ───────────────────────────────────────────────────────────────
class EvalSpec(_Strict):
    """The held-out split and how it is measured (trainer eval_every, flywheel eval, demo)."""

    source: SourceSpec | None = Field(
        None, description="A separate held-out source (e.g. a test JSONL), same fields as source."
    )
    holdout: float = Field(
        0.0,
        ge=0.0,
        le=0.9,
        description="Instead: this fraction of the training source, chosen by a seeded hash, "
        "is held back from training and evaluated on.",
    )
    seed: int = Field(0, description="Seed of the holdout choice.")
    size: int = Field(200, ge=1, description="Evaluate at most this many held-out rows.")
    k: int = Field(1, ge=1, le=64, description="pass@k: samples per prompt (1: greedy only).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of pass@k.")
    max_new_tokens: int = Field(64, ge=1, description="Generation limit in evaluation.")
    part: str | None = Field(
        None, description="The reward part that decides 'correct' (default: the first part)."
    )
    threshold: float = Field(1.0, description="Correct when that part's value is >= this.")

    @model_validator(mode="after")
    def _one_split(self) -> EvalSpec:
        if self.source is not None and self.holdout > 0:
            raise ValueError("eval: give source or holdout, not both")
        return self

    @property
    def enabled(self) -> bool:
        return self.source is not None or self.holdout > 0


# ── the task ─────────────────────────────────────────────────────────────────
class TaskSpec(_Strict):
    """One task: where prompts come from, how they are shown, how answers are scored."""

    source: SourceSpec = Field(description="Where the prompts come from (type = ...).")
    reward: tuple[RewardPart, ...] = Field(
        (),
        description="One reward ('math', 'pkg.module:function', or a table with fn = ...) or a "
        "list of parts, summed with their weights. Default for arithmetic: exact_match; for "
        "reasoning_gym: the generator's own scorer; required otherwise.",
    )
    system_prompt: str | None = Field(None, description="Prepended as a system message.")
    prompt_template: str = Field(
        "{prompt}", description="Python format string around each prompt; {prompt} is the text."
    )
    chat_template: bool = Field(
        True,
        description="Render prompts with the tokenizer's chat template (when it has one); "
        "false: plain prompts are tokenized as they are.",
    )
    weight: float | None = Field(
        None, gt=0, description="Mixtures: share of this task's prompts (default: its size)."
    )
    eval: EvalSpec = Field(default_factory=EvalSpec)
    episode: EpisodeSpec | None = Field(
        None,
        description="Roll out as a multi-turn episode with tools ([task.episode]); "
        "none: one completion per sample.",
    )
    sandbox: Literal["required", "insecure-allow"] = Field(
        "required",
        description="Custom rewards, verifiers rubrics and python/function tools run in the "
        "sandbox (bubblewrap: no network, no writes, no environment; docs/security/sandbox.md). "
        "'required': a service on a host that cannot give one refuses to start. "
        "'insecure-allow': there, run them as plain processes (limits, no walls).",
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        """'math' -> [{fn = 'math'}]; one table -> a list of one; ["a", "b"] -> two parts."""
        if isinstance(v, str | dict):
            v = [v]
        if isinstance(v, list | tuple):
            return [{"fn": p} if isinstance(p, str) else p for p in v]
        return v

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
        except ValueError as e:
            raise ValueError(f"not a format string: {e}") from e
        if names != {"prompt"}:
            raise ValueError(f"must use {{prompt}} and no other field, found {sorted(names)}")
        return v

    @model_validator(mode="after")
    def _reward_fits(self) -> TaskSpec:
        kind = self.source.type
        if not self.reward:
            default = _DEFAULT_PART.get(kind)
            if default is None:
                raise ValueError(
                    f'reward: required for source type {kind!r} (e.g. reward = "math", '
                    '"exact_match", "gsm8k" or "pkg.module:function")'
                )
            object.__setattr__(self, "reward", (default,))
        for i, part in enumerate(self.reward):
            own = {ReasoningGymScore: "reasoning_gym", VerifiersRubric: "verifiers"}.get(type(part))
            kinds = {kind, self.eval.source.type if self.eval.source else kind}
            if own is not None and kinds != {own}:
                raise ValueError(f"reward[{i}]: {own!r} needs source type {own!r}")
        names = [p.part_name for p in self.reward]
        if len(set(names)) != len(names):
            raise ValueError(f"reward: part names must differ (set name = ...), got {names}")
        if self.eval.part is not None and self.eval.part not in names:
            raise ValueError(f"eval.part: {self.eval.part!r} is not a reward part ({names})")
        return self

    @property
    def correct_part(self) -> str:
        return self.eval.part or self.reward[0].part_name


# The reward of a source type given no `reward` (others must give one).
_DEFAULT_PART = {
    "arithmetic": ExactMatch(fn="exact_match"),
    "reasoning_gym": ReasoningGymScore(fn="reasoning_gym"),
    "verifiers": VerifiersRubric(fn="verifiers"),
}

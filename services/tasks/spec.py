"""The task spec: the `[task]` table (or `[tasks.<name>]` tables) of a run file, typed.

One spec, validated the same way by every service at start-up: the buffer
reads its `source` (what to prompt with), the rollout worker its `reward`
(how to score), the trainer and `flywheel eval` its `eval` (what to hold out,
the validation and test splits, and how to measure). A PromptTask names its
task (`task_name`, `env` on the wire) and the row of that task's source, so
each service resolves the rest from its own copy of the same file and
nothing but a name travels.

Everything here is pure validation: no file is opened and nothing heavy is
imported. Checks that need the disk or an optional package (a file exists,
math-verify is installed, a custom function imports) are `check()` in
services.tasks.taskset, run by each service before it starts work.

The sources and rewards are classes registered where they are defined
(registry.py); `source` and `reward` accept whatever is registered. The
built-in ones are imported here, so a spec that validates knows them all.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

# Importing a module registers the sources and rewards it defines.
from services.tasks import (  # noqa: F401
    arithmetic,
    judge,
    reasoning_gym,
    rewards,
    sources,
    verifiers_env,
    verifiers_v1,
)
from services.tasks.episode_spec import EpisodeSpec
from services.tasks.registry import (
    REWARDS,
    AnyRewardPart,
    AnySource,
    SourceSpec,
    Strict,
)


# ── evaluation ───────────────────────────────────────────────────────────────
class EvalSpec(Strict):
    """The held-out splits and how they are measured.

    Two held-out splits, never trained on (in SFT or RL): `validation`, which
    the trainer evaluates every `eval_every` steps and chooses its best
    checkpoint on (best.json, `--target-accuracy`), and `test`, which only
    reports (`flywheel eval`, the demo's before/after), so the reported
    figure is not the one the checkpoint was picked for.
    """

    source: AnySource | None = Field(
        None,
        description="A separate validation source (e.g. a dev JSONL), same fields as source. "
        "Rows whose prompt also occurs in the training source are dropped from training.",
    )
    test_source: AnySource | None = Field(
        None,
        description="A separate test source, reported by `flywheel eval` and the demo; none: "
        "they report on validation and say so. Its prompts are dropped from training too.",
    )
    holdout: float = Field(
        0.0,
        ge=0.0,
        le=0.9,
        description="Instead of sources: this fraction of the training source's prompts is "
        "held back from training, chosen by a seeded hash of the prompt text (a prompt that "
        "repeats is held out everywhere it occurs), and split into validation and test.",
    )
    test_share: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="holdout: the share of held-out prompts that are test (the rest validation).",
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
        if (self.source is not None or self.test_source is not None) and self.holdout > 0:
            raise ValueError("eval: give source (and test_source) or holdout, not both")
        if self.test_source is not None and self.source is None:
            raise ValueError("eval.test_source: needs eval.source (the validation split)")
        if self.source is not None:
            object.__setattr__(self, "source", self.source.in_split("validation", "eval.source"))
        if self.test_source is not None:
            object.__setattr__(
                self, "test_source", self.test_source.in_split("test", "eval.test_source")
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.source is not None or self.holdout > 0

    @property
    def sources(self) -> tuple[SourceSpec, ...]:
        """The separate held-out sources given (validation, then test)."""
        return tuple(s for s in (self.source, self.test_source) if s is not None)


# ── the task ─────────────────────────────────────────────────────────────────
class TaskSpec(Strict):
    """One task: where prompts come from, how they are shown, how answers are scored."""

    source: AnySource = Field(description="Where the prompts come from (type = ...).")
    reward: tuple[AnyRewardPart, ...] = Field(
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
    def _train_split(self) -> TaskSpec:
        object.__setattr__(self, "source", self.source.in_split("train", "source"))
        return self

    @model_validator(mode="after")
    def _unsandboxed_env(self) -> TaskSpec:
        """A verifiers v1 env scores its episodes in the rollout worker's own process (its
        rewards read the whole trace, which only the episode has), outside the sandbox and
        next to the worker's credentials: the run file must say it accepts that."""
        if self.source.kind == "verifiers-v1" and self.sandbox != "insecure-allow":
            raise ValueError(
                "a verifiers-v1 source runs the environment's rewards in the rollout worker's "
                "process, outside the sandbox (docs/verifiers.md): set "
                'sandbox = "insecure-allow" in this [task] to accept that'
            )
        return self

    @model_validator(mode="after")
    def _reward_fits(self) -> TaskSpec:
        kind = self.source.kind
        if not self.reward:
            default = self.source.default_reward
            if default is None:
                raise ValueError(
                    f'reward: required for source type {kind!r} (e.g. reward = "math", '
                    '"exact_match", "gsm8k" or "pkg.module:function")'
                )
            object.__setattr__(
                self, "reward", (REWARDS.kinds[default].model_validate({"fn": default}),)
            )
        for i, part in enumerate(self.reward):
            own = part.own_source
            kinds = {kind, *(src.kind for src in self.eval.sources)}
            if own is not None and kinds != {own}:
                raise ValueError(f"reward[{i}]: {own!r} needs source type {own!r}")
        names = [p.part_name for p in self.reward]
        if len(set(names)) != len(names):
            raise ValueError(f"reward: part names must differ (set name = ...), got {names}")
        if self.eval.part is not None and self.eval.part not in names:
            raise ValueError(f"eval.part: {self.eval.part!r} is not a reward part ({names})")
        judged = [p.part_name for p in self.reward if p.external]
        if self.eval.part is not None and self.eval.part in judged:
            raise ValueError(
                f"eval.part: {self.eval.part!r} is a judge part; the held-out evaluation "
                "scores the verifiable parts only (name one of them)"
            )
        return self

    @property
    def correct_part(self) -> str:
        """The part that decides 'correct': eval.part, else the first one evaluation scores
        (a judge part is not scored there: scoring.Scorer)."""
        verifiable = (p.part_name for p in self.reward if not p.external)
        return self.eval.part or next(verifiable, self.reward[0].part_name)

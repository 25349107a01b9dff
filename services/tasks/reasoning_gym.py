"""reasoning-gym tasks: its generators as a source, its own scorer as a reward (extra: reasoning).

`source = { type = "reasoning_gym", dataset = "leg_counting" }` indexes the
generator's problems lazily (procedural: nothing is downloaded); its reward,
by default, is the generator's own `score_answer` on the same row, run in
the verifier sandbox like every reward.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from services.runtime.errors import ConfigError
from services.tasks.registry import REWARDS, SOURCES, RewardPart, Rows, SourceSpec
from services.tasks.sources import MappedRows, require


@SOURCES.register
class ReasoningGymSource(SourceSpec):
    """A reasoning-gym generator (extra: reasoning); procedural, nothing is downloaded."""

    default_reward: ClassVar[str | None] = "reasoning_gym"

    type: Literal["reasoning_gym"]
    dataset: str = Field(description="Generator name, e.g. 'basic_arithmetic', 'leg_counting'.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The generator's own options (its *Config fields)."
    )
    size: int = Field(10_000, ge=1, description="Number of distinct problems.")
    seed: int = Field(0, description="Seed of the generator.")

    def rows(self, key: str) -> Rows:
        data = reasoning_gym_dataset(
            self.dataset, json.dumps(self.config, sort_keys=True), self.seed, self.size
        )
        return MappedRows(data, _RG_FIELDS, f"reasoning_gym:{self.dataset}")

    def check(self, key: str, *, data: bool) -> None:
        require("reasoning_gym", f"{key}: type 'reasoning_gym'", "reasoning")

    def task_name(self) -> str:
        return f"reasoning_gym:{self.dataset}"

    def scorer_context(self) -> dict[str, Any] | None:
        return self.model_dump(mode="json")


@REWARDS.register
class ReasoningGymScore(RewardPart):
    """The reasoning-gym generator's own `score_answer` (source type 'reasoning_gym')."""

    own_source: ClassVar[str | None] = "reasoning_gym"

    fn: Literal["reasoning_gym"]

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return _score(completion, ctx["source"], int(ctx["row"])), {}

    def warm(self, ctx: dict[str, Any]) -> None:
        if "source" in ctx:
            _score("", ctx["source"], 0)  # builds (and caches) the dataset


def _score(completion: str, source: dict[str, Any], row: int) -> float:
    return reasoning_gym_score(
        completion, dataset=source["dataset"], config=source["config"], seed=source["seed"],
        size=source["size"], row=row,
    )  # fmt: skip


def reasoning_gym_score(
    completion: str, *, dataset: str, config: dict[str, Any], seed: int, size: int, row: int
) -> float:
    """The generator's own score_answer on row `row` of the (cached) dataset."""
    data = reasoning_gym_dataset(dataset, json.dumps(config, sort_keys=True), seed, size)
    return float(data.score_answer(answer=completion.strip(), entry=data[row]))


@dataclass(frozen=True)
class _RgFields:
    prompt_field: str = "question"
    messages_field: str = "messages"
    answer_field: str = "answer"
    answer_marker: str | None = None


_RG_FIELDS = _RgFields()


@functools.lru_cache(maxsize=16)
def reasoning_gym_dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    """A reasoning-gym dataset (cached: the sandbox's scorer asks for it per completion)."""
    rg = require("reasoning_gym", "source type 'reasoning_gym'", "reasoning")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"reasoning_gym dataset {name!r}: {e}") from e

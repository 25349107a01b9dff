"""What a task's source and a reward part are, and the registries of them.

A source (`[task] source = { type = ... }`) and a reward part (`reward = "math"`,
`{ fn = ... }`) are each one pydantic class, registered where it is defined
with `@SOURCES.register` / `@REWARDS.register`. Everything that lists them
derives from the registry: the task spec's fields (`AnySource`, `AnyRewardPart`
validate by the tag, `type` or `fn`, against whatever is registered when they
validate), the JSON schema, the error for an unknown tag (naming every
registered one) and the built-in reward names. A class knows what it does:
a source its rows and its start-up checks, a reward part its value (in the
verifier sandbox's child process), its warm-up and its checks. So a new one
is one class in one file, and nothing else branches on which one it is.

The validation is pydantic's own per class; only the dispatch on the tag is
here, with the errors pydantic's discriminated unions give, so a run file's
mistakes read the same ("[task] source.path: Field required").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Generic, Protocol, TypeVar, cast, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError, PydanticKnownError, core_schema

FN_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
"""A function by import path, 'pkg.module:function' (custom rewards, function sources)."""


class Strict(BaseModel):
    """A spec table: unknown keys are errors, values frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ── what a source yields ───────────────────────────────────────────────────────
@dataclass(frozen=True)
class Row:
    """One problem: a prompt (text or chat messages) and its reference answer."""

    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    answer: str | None = None
    solution: str | None = None  # the answer as written (SFT target); `answer` may be cut


class Rows(Protocol):
    def __len__(self) -> int: ...
    def row(self, index: int) -> Row: ...


# ── the bases ────────────────────────────────────────────────────────────────
class SourceSpec(Strict):
    """Where a task's prompts come from. Subclasses declare `type: Literal["<tag>"]`."""

    default_reward: ClassVar[str | None] = None  # the reward when the task names none
    splits_apart: ClassVar[bool] = False  # its splits are disjoint by construction (in_split)

    @property
    def kind(self) -> str:
        """Its `type`, the tag it is registered under."""
        return str(getattr(self, "type", ""))

    def rows(self, key: str) -> Rows:
        """The rows; ConfigError names `key` (e.g. '[task] source') on failure."""
        raise NotImplementedError

    def check(self, key: str, *, data: bool) -> None:
        """Start-up checks needing the disk or optional packages (`data`: the source's
        files too: the buffer, trainer and `flywheel up`; a rollout worker reads none)."""

    def task_name(self) -> str:
        """The name of a lone `[task]` with this source."""
        return self.kind

    def scorer_context(self) -> dict[str, Any] | None:
        """What a reward of its own needs in the sandbox (the source itself), or None."""
        return None

    def sandbox_modules(self) -> tuple[str, ...]:
        """User modules a reward of its own imports in the sandbox (verifiers: the env's)."""
        return ()

    def in_split(self, split: str, key: str) -> SourceSpec:
        """This source where it stands in a task: `split` is "train" (`source`), "validation"
        (`eval.source`) or "test" (`eval.test_source`). A source that partitions its own
        problem space (arithmetic) draws only that split's problems; the others are their
        own split (their rows, not their position, keep the splits apart: taskset.py).
        ValueError (a spec error at `key`) when it was told another split."""
        return self


class RewardPart(Strict):
    """One part of a task's reward (a weighted sum). Subclasses declare `fn: Literal["<tag>"]`.

    `value` runs in the verifier sandbox's child, on a copy built without
    validation (`REWARDS.rebuild`): keep it a pure function of the fields.
    """

    own_source: ClassVar[str | None] = None  # the source type this reward only works with
    # Calls code Flywheel does not know (a user's function, another package's rubric).
    calls_code: ClassVar[bool] = False
    # Reads the completion only as text (regular expressions, numbers), never parses or
    # runs it as code: the sandbox may answer it without a fork (rewards.pure).
    text_only: ClassVar[bool] = False
    # Scored by the service outside the sandbox (an LLM judge over HTTP: judge.py), not by
    # `value` in the sandbox's child; the sandbox never sees it (scoring.reward_payload).
    external: ClassVar[bool] = False

    weight: float = Field(1.0, description="Weight of this part in the reward (a weighted sum).")
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name in reward_parts and the trainer's logs (default: fn).",
    )

    @property
    def part_name(self) -> str:
        return self.name or str(getattr(self, "fn", "")).rpartition(":")[2]

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        """This part's value of one completion (and any sub-parts), in the sandbox.
        `ctx`: `row`, `response_tokens`, and `source` when the source gives one."""
        raise NotImplementedError

    def warm(self, ctx: dict[str, Any]) -> None:
        """In a new sandbox child, before it serves: import or build what `value` needs."""

    def check(self, key: str) -> None:
        """Start-up checks that need the disk or optional packages (ConfigError naming `key`)."""

    @property
    def runs_code(self) -> bool:
        """Runs code Flywheel does not know: a part defined outside Flywheel, or one that
        calls such code. Where the host has no sandbox, it runs only if its task says
        sandbox = "insecure-allow" (scoring.py)."""
        return self.calls_code or not type(self).__module__.startswith("services.")

    def sandbox_modules(self) -> tuple[str, ...]:
        """The modules the sandbox must show for `value` to run (their top-level packages
        are bound into it, services/sandbox/jail.py): its class's, and any user code it calls."""
        return (type(self).__module__,)


# ── the registries ───────────────────────────────────────────────────────────
K = TypeVar("K", bound=Strict)
C = TypeVar("C", bound=Strict)


class Registry(Generic[K]):
    """The registered classes of one kind, by tag; also the pydantic type of a spec field.

    `tag_of` reads a value's tag (None: it has none); `unknown` is the error
    for a value whose tag is missing or not registered.
    """

    def __init__(
        self,
        key: str,
        base: type[K],
        tag_of: Callable[[Any], str | None],
        unknown: Callable[[Registry[K], Any, str | None], Exception],
    ) -> None:
        self.key = key
        self.base = base
        self.tag_of = tag_of
        self.unknown = unknown
        self.kinds: dict[str, type[K]] = {}

    def register(self, cls: type[C]) -> type[C]:
        """Class decorator: register `cls` under its tag (its `key` field's Literal, or
        its `tag` class variable when the field is free text)."""
        tag = cls.__dict__.get("tag") or _literal(cls, self.key)
        known = self.kinds.get(tag)
        if known is not None and known is not cls:
            raise ValueError(f"{self.key} {tag!r} is registered twice: {known} and {cls}")
        self.kinds[tag] = cls  # type: ignore[assignment]  # C is a K: the decorator's user
        return cls

    @property
    def tags(self) -> tuple[str, ...]:
        """The registered tags, sorted (registration order depends on import order)."""
        return tuple(sorted(self.kinds))

    def validate(self, value: Any) -> K:
        if isinstance(value, self.base) and type(value) in self.kinds.values():
            return value
        tag = self.tag_of(value)
        cls = self.kinds.get(tag) if tag is not None else None
        if cls is None:
            raise self.unknown(self, value, tag)
        return cls.model_validate(value)  # its errors keep their location under this field

    def rebuild(self, fields: dict[str, Any]) -> K:
        """The sandbox child's copy of a part sent as plain fields (`as_fields`), unvalidated:
        the parent validated it. Its class's module is imported first (a reward defined
        outside the built-ins registers when its module is imported)."""
        fields = dict(fields)
        importlib.import_module(fields.pop("_module"))
        cls = self.kinds[str(self.tag_of(fields))]
        return cast(K, cls.model_construct(**fields))

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return {
            "oneOf": [handler(self.kinds[t].__pydantic_core_schema__) for t in self.tags],
            "discriminator": {"propertyName": self.key},
        }


def as_fields(spec: Strict) -> dict[str, Any]:
    """A spec as plain fields for the sandbox child, with the module that defines its class."""
    return {**spec.model_dump(mode="json"), "_module": type(spec).__module__}


def _literal(cls: type[Strict], key: str) -> str:
    (tag,) = get_args(cls.model_fields[key].annotation)
    return str(tag)


def _source_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        raise PydanticKnownError("model_attributes_type")
    tag = value.get("type")
    return tag if isinstance(tag, str) else None


def _unknown_source(reg: Registry[Any], value: Any, tag: str | None) -> Exception:
    if tag is None:
        return PydanticKnownError("union_tag_not_found", {"discriminator": "'type'"})
    expected = ", ".join(f"'{t}'" for t in reg.tags)
    return PydanticKnownError(
        "union_tag_invalid", {"discriminator": "'type'", "tag": tag, "expected_tags": expected}
    )


def _reward_tag(value: Any) -> str | None:
    if isinstance(value, dict):  # `type = "judge"` names a part as `fn` does
        fn = value.get("fn", value.get("type", ""))
    else:
        fn = getattr(value, "fn", "")
    if not isinstance(fn, str):
        return None
    return "custom" if ":" in fn else fn


def _unknown_reward(reg: Registry[Any], value: Any, tag: str | None) -> Exception:
    return PydanticCustomError(
        "unknown_reward",
        "fn must be one of {names} or 'pkg.module:function'",
        {"names": ", ".join(builtin_rewards())},
    )


SOURCES: Registry[SourceSpec] = Registry("type", SourceSpec, _source_tag, _unknown_source)
REWARDS: Registry[RewardPart] = Registry("fn", RewardPart, _reward_tag, _unknown_reward)


def builtin_rewards() -> tuple[str, ...]:
    """The rewards a run file names by name: every registered one but a custom function."""
    return tuple(t for t in REWARDS.tags if t != "custom")


AnySource = Annotated[SourceSpec, SOURCES]
"""A `source` table: validated as the registered class its `type` names."""
AnyRewardPart = Annotated[RewardPart, REWARDS]
"""A reward part: validated as the registered class its `fn` names."""

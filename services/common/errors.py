"""Typed errors of the service runtime (wire errors live in proto.errors)."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin

if TYPE_CHECKING:
    from pydantic import ValidationError


class FlywheelError(Exception):
    """Base of every error Flywheel raises on purpose."""


class ConfigError(FlywheelError, ValueError):
    """A setting is missing or invalid; the message names the field."""

    @classmethod
    def from_validation(
        cls, err: ValidationError, section: str, model: type | None = None
    ) -> ConfigError:
        """One line per error. With `model` (the settings class validated), an unknown key
        says which keys its table has and the nearest, not only "Extra inputs are not
        permitted"."""
        errors = err.errors()
        missing = {tuple(e["loc"][:-1]): e["loc"][-1] for e in errors if e["type"] == "missing"}
        lines = []
        for e in errors:
            msg = e["msg"]
            if e["type"] == "extra_forbidden" and model is not None:
                msg = unknown_key(model, tuple(e["loc"]), missing) or msg
            lines.append(error_line(e["loc"], msg, section))
        return cls("invalid settings:\n  " + "\n  ".join(lines))


def unknown_key(
    model: type, loc: tuple[int | str, ...], missing: dict[tuple[int | str, ...], int | str]
) -> str | None:
    """What to say of the unknown key at `loc`: `unknown key; did you mean 'dataset'? (this
    table's keys: …)`, or None when its table cannot be found. The nearest is the closest
    spelling, else the one required key the same table lacks (`name` where `dataset` is
    required)."""
    keys = table_keys(model, loc[:-1])
    if not keys:
        return None
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    lacking = missing.get(loc[:-1])
    if near:
        hint = f"did you mean {near[0]!r}? "
    elif lacking is not None:
        hint = f"did you mean {lacking!r} (required, not given)? "
    else:
        hint = ""
    return f"unknown key; {hint}(this table's keys: {', '.join(keys)})"


def table_keys(model: type, path: tuple[int | str, ...]) -> list[str]:
    """The keys of the table at `path` inside the pydantic model `model` (following fields,
    dict values, list items and discriminated unions by their tag); [] if it is not one.
    At the top of a service's settings: its own section's keys, not the shared ones."""
    t: Any = model
    for part in path:
        t = _inner(t, part)
        if t is None:
            return []
    t = _model_of(t)
    if t is None:
        return []
    fields = list(t.model_fields)
    section: object = getattr(t, "section", None)
    if not path and section:  # a service's [section]: its own keys
        base = next(c for c in reversed(t.__mro__) if getattr(c, "section", None) == "")
        fields = [f for f in fields if f not in base.model_fields] or fields
    return fields


def _options(t: Any) -> list[tuple[Any, tuple[Any, ...]]]:
    """What `t` may be, each with its Annotated metadata (pydantic's `Tag`s among it):
    unions and Optional unwrapped."""
    meta: tuple[Any, ...] = ()
    while hasattr(t, "__metadata__"):  # Annotated[X, ...]
        meta += t.__metadata__
        t = get_args(t)[0]
    if get_origin(t) is Union or type(t).__name__ == "UnionType":
        return [o for a in get_args(t) if a is not type(None) for o in _options(a)]
    return [(t, meta)]


def _model_of(t: Any) -> Any:
    models = [m for m, _ in _options(t) if hasattr(m, "model_fields")]
    return models[0] if len(models) == 1 else None


def _inner(t: Any, part: int | str) -> Any:
    """The type one step down `part` from `t`, or None."""
    options = _options(t)
    if isinstance(part, str):  # a union's tag: pydantic puts it in the location
        for m, meta in options:
            if any(getattr(x, "tag", None) == part for x in meta):
                return m
            tag = getattr(m, "model_fields", {}).get("type")
            if tag is not None and part in get_args(tag.annotation):
                return m
    for m, _ in options:
        if hasattr(m, "model_fields") and isinstance(part, str) and part in m.model_fields:
            return m.model_fields[part].annotation
        origin, args = get_origin(m), get_args(m)
        if origin is dict and len(args) == 2 and isinstance(part, str):
            return args[1]
        if origin in (list, tuple) and args and isinstance(part, int):
            return args[0]
    return None


# Discriminator tags pydantic puts in an error's location (`task.source.jsonl.path`):
# not keys of the run file, so left out of the key it names (`[task] source.path`).
_TAGS = set(
    "jsonl hf reasoning_gym function arithmetic exact_match numeric math gsm8k format "
    "soft_overlong custom verifiers".split()
)


def error_line(loc: tuple[int | str, ...], msg: str, section: str) -> str:
    """`[section] key.path: message`; the task spec's keys under `[task]` / `[tasks.<name>]`."""
    msg = msg.removeprefix("Value error, ")
    parts = list(loc)
    if parts and parts[0] in ("task", "tasks"):
        head = parts.pop(0)
        section = f"{head}.{parts.pop(0)}" if head == "tasks" and parts else str(head)
    key = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            key += f"[{p}]"
        elif i > 0 and p in _TAGS and (isinstance(parts[i - 1], int) or parts[i - 1] == "source"):
            continue
        else:
            key += f".{p}" if key else str(p)
    if key:
        return f"[{section}] {key}: {msg}"
    return msg if msg.startswith("[") else f"[{section}] {msg}"


class NatsServerError(FlywheelError, RuntimeError):
    """The embedded nats-server could not be found or started."""


class RetryableError(FlywheelError, RuntimeError):
    """A transient failure handling a message: redeliver it later (nak with a delay).

    `delay_s` overrides the message loop's backoff (e.g. "the engine is
    loading weights, retry in 5 s"). After the consumer's max_deliver the
    message is dead-lettered instead.
    """

    def __init__(self, message: str, *, delay_s: float | None = None) -> None:
        self.delay_s = delay_s
        super().__init__(message)


class PermanentError(FlywheelError, ValueError):
    """A message that can never be handled (e.g. a sample older than the staleness bound).

    The message loop dead-letters it to `flywheel.<run>.dlq.<reason>` and
    terminates it; `reason` is a subject token (`[A-Za-z0-9_-]`). `expected`:
    a drop by design (a filtered or stale group), counted but not logged as
    a warning, so the console keeps warnings for what a user must act on.
    """

    def __init__(self, message: str, *, reason: str = "rejected", expected: bool = False) -> None:
        self.reason = reason
        self.expected = expected
        super().__init__(message)


class RunHalted(FlywheelError, RuntimeError):
    """The run must stop: the same error hits every task, so going on only burns data.

    Raised by the buffer's fail-fast watch; the service exits with
    `EXIT_HALTED`, which `flywheel up` takes as "stop the whole run" (never
    "restart the service"), printing this message.
    """


EXIT_CONFIG = 2  # a setting is invalid: restarting cannot help
EXIT_HALTED = 3  # RunHalted: restarting cannot help either

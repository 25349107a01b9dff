"""Typed errors of the service runtime (wire errors live in proto.errors)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin

if TYPE_CHECKING:
    from pydantic import ValidationError


class FlywheelError(Exception):
    """Base of every error Flywheel raises on purpose."""


class ConfigError(FlywheelError, ValueError):
    """A setting is missing or invalid; the message names the field."""

    @classmethod
    def from_validation(
        cls,
        err: ValidationError,
        section: str,
        tables: Mapping[str, bool] | None = None,
        model: type | None = None,
        data: Any = None,
    ) -> ConfigError:
        """One line per error. With `model` (the settings class validated) and `data` (the
        values it was given), an unknown key says which keys its table has and the
        nearest, not only "Extra inputs are not permitted"."""
        errors = err.errors()
        missing = {tuple(e["loc"][:-1]): e["loc"][-1] for e in errors if e["type"] == "missing"}
        lines = []
        for e in errors:
            msg = e["msg"]
            if e["type"] == "extra_forbidden" and model is not None:
                msg = unknown_key(model, data, tuple(e["loc"]), missing) or msg
            lines.append(error_line(e["loc"], msg, section, tables))
        return cls("invalid settings:\n  " + "\n  ".join(lines))


def unknown_key(
    model: type,
    data: Any,
    loc: tuple[int | str, ...],
    missing: dict[tuple[int | str, ...], int | str],
) -> str | None:
    """What to say of the unknown key at `loc`: `unknown key; did you mean 'dataset'? (this
    table's keys: …)`, or None when its table cannot be found. The nearest is the closest
    spelling, else the one required key the same table lacks (`name` where `dataset` is
    required)."""
    keys = table_keys(model, data, loc[:-1])
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


def table_keys(model: type, data: Any, path: tuple[int | str, ...]) -> list[str]:
    """The keys of the table at `path` inside the pydantic model `model` given `data`
    (following fields, dict values, list items, discriminated unions by their tag, and
    registries by the tag of the value given); [] if it is not one. At the top of a
    service's settings: its own section's keys, not the shared ones."""
    t: Any = model
    for part in path:
        t = _inner(t, data, part)
        data = _step(data, part)
        if t is None:
            return []
    t = _model_of(t, data)
    if t is None:
        return []
    fields = list(t.model_fields)
    section: object = getattr(t, "section", None)
    if not path and section:  # a service's [section]: its own keys
        shared = next(c for c in t.__mro__ if getattr(c, "section", None) == "")
        fields = [f for f in fields if f not in shared.model_fields] or fields
    return fields


def _step(data: Any, part: int | str) -> Any:
    """The value one step down `part` in the given values (None when there is none)."""
    if isinstance(data, dict):
        return data.get(part)
    if isinstance(data, list | tuple) and isinstance(part, int) and 0 <= part < len(data):
        return data[part]
    return None


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


def _registered(meta: tuple[Any, ...], data: Any) -> Any:
    """The class a registry in `meta` validates `data` as (its tag's), or None. A
    registry (services/tasks/registry.py: a field typed `Annotated[Base, REGISTRY]`)
    is known by its `kinds` (tag -> class) and `tag_of` (a value's tag)."""
    if not isinstance(data, dict):
        return None
    for x in meta:
        kinds, tag_of = getattr(x, "kinds", None), getattr(x, "tag_of", None)
        if isinstance(kinds, dict) and callable(tag_of):
            return kinds.get(tag_of(data))
    return None


def _model_of(t: Any, data: Any = None) -> Any:
    models = [_registered(meta, data) or m for m, meta in _options(t)]
    models = [m for m in models if hasattr(m, "model_fields")]
    return models[0] if len(models) == 1 else None


def _inner(t: Any, data: Any, part: int | str) -> Any:
    """The type one step down `part` from `t` (holding `data`), or None."""
    options = [(_registered(meta, data) or m, meta) for m, meta in _options(t)]
    if isinstance(part, str):  # a discriminated union's tag: pydantic puts it in the location
        for m, meta in options:
            if any(getattr(x, "tag", None) == part for x in meta):
                return m
            tag = getattr(m, "model_fields", {}).get("type")
            if tag is not None and part in get_args(tag.annotation):
                return m
    for m, _ in options:
        if hasattr(m, "model_fields") and isinstance(part, str) and part in m.model_fields:
            field = m.model_fields[part]  # pydantic keeps a field's Annotated metadata apart
            return (
                Annotated[(field.annotation, *field.metadata)]
                if field.metadata
                else field.annotation
            )
        origin, args = get_origin(m), get_args(m)
        if origin is dict and len(args) == 2 and isinstance(part, str):
            return args[1]
        if origin in (list, tuple) and args and isinstance(part, int):
            return args[0]
    return None


def error_line(
    loc: tuple[int | str, ...], msg: str, section: str, tables: Mapping[str, bool] | None = None
) -> str:
    """`[section] key.path: message`. A field that is a table of its own in the run file
    (`tables`: its name -> whether it holds named tables, as `[tasks.<name>]`) is named
    by that table: the task spec's keys under `[task]` / `[tasks.<name>]`."""
    msg = msg.removeprefix("Value error, ")
    parts = list(loc)
    if parts and tables and parts[0] in tables:
        head = str(parts.pop(0))
        section = f"{head}.{parts.pop(0)}" if tables[head] and parts else head
    key = ""
    for p in parts:
        if isinstance(p, int):
            key += f"[{p}]"
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


class RunDone(FlywheelError, RuntimeError):
    """The run has nothing left to do before its end was reached: the buffer's whole
    training set is solved (`[buffer] on_solved = "stop"`).

    The service exits with `EXIT_DONE`, which `flywheel up` takes as the run's
    end, as it takes the trainer's exit after `max_steps`: not a failure, never
    a restart. The message says why, in one line.
    """


class JetStreamMissing(FlywheelError, RuntimeError):
    """A stream, KV bucket or durable consumer the service works on is not on the server.

    Deleted under a running service, or never made where the service may not
    create it (a run name or account that differs from the one the streams
    were made for). Retrying cannot bring it back, and restarting would make
    it again empty (every service ensures its streams at start), silently
    losing what it held; so the service stops with `EXIT_MISSING`, naming
    it, and `flywheel up` stops the run (services/runtime/missing.py).
    """

    def __init__(self, kind: str, name: str, doing: str) -> None:
        self.kind = kind  # "stream", "KV bucket" or "consumer"
        self.name = name
        self.doing = doing
        super().__init__(
            f"JetStream {kind} {name} does not exist ({doing}): deleted while the run was "
            "going, or made under another run name or NATS account. Restarting would make it "
            "again, empty: restore it (nats stream restore) or start the run afresh."
        )


EXIT_CONFIG = 2  # a setting is invalid: restarting cannot help
EXIT_HALTED = 3  # RunHalted: restarting cannot help either
EXIT_MISSING = 4  # JetStreamMissing: a restart would recreate it empty
EXIT_DONE = 5  # RunDone: the run's work is done; its end, not a failure

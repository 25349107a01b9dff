"""Typed errors of the service runtime (wire errors live in proto.errors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class FlywheelError(Exception):
    """Base of every error Flywheel raises on purpose."""


class ConfigError(FlywheelError, ValueError):
    """A setting is missing or invalid; the message names the field."""

    @classmethod
    def from_validation(
        cls, err: ValidationError, section: str, tables: Mapping[str, bool] | None = None
    ) -> ConfigError:
        lines = (error_line(e["loc"], e["msg"], section, tables) for e in err.errors())
        return cls("invalid settings:\n  " + "\n  ".join(lines))


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


EXIT_CONFIG = 2  # a setting is invalid: restarting cannot help
EXIT_HALTED = 3  # RunHalted: restarting cannot help either

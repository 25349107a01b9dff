"""Typed errors of the service runtime (wire errors live in proto.errors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class FlywheelError(Exception):
    """Base of every error Flywheel raises on purpose."""


class ConfigError(FlywheelError, ValueError):
    """A setting is missing or invalid; the message names the field."""

    @classmethod
    def from_validation(cls, err: ValidationError, section: str) -> ConfigError:
        lines = []
        for e in err.errors():
            field = ".".join(str(p) for p in e["loc"]) or "<root>"
            lines.append(f"[{section}] {field}: {e['msg']}")
        return cls("invalid settings:\n  " + "\n  ".join(lines))


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
    terminates it; `reason` is a subject token (`[A-Za-z0-9_-]`).
    """

    def __init__(self, message: str, *, reason: str = "rejected") -> None:
        self.reason = reason
        super().__init__(message)

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

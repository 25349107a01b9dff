"""A call in the sandbox: the function a path names, its result as a `Reward`, the
environment it declares.

The sandbox's child (zygote.py) and the code it runs (tasks' rewards.py and
tools.py) both use these: so they live here, in the sandbox below tasks, and
the package's face (services/sandbox/__init__.py) exports them.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from services.runtime.errors import ConfigError


@dataclass(frozen=True)
class Reward:
    """A verifier's verdict: reward, optional named parts, and the error if it failed."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    # Why it is unscored, as a dead-letter reason (`dlq.<reason>`), whenever `error` is
    # set: a check in the sandbox that timed out, crashed or raised (`verifier_timeout`,
    # `verifier_crashed`, `verifier_raised`), an LLM judge (judge.JUDGE_REASONS), an
    # environment's episode (`env_error`). The rollout worker dead-letters the sample.
    reason: str | None = None


def resolve(path: str) -> Callable[..., Any]:
    """Import "pkg.module:function"; ConfigError naming the path if it cannot."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"verifier {path!r} must look like 'pkg.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import verifier {path!r}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"verifier {path!r} is not callable")
    return fn


def to_reward(value: Any) -> Reward:
    """Accept a number, (number, parts) or {"reward": number, "parts": {...}}."""
    parts: dict[str, float] = {}
    if isinstance(value, dict):
        parts = {str(k): float(v) for k, v in (value.get("parts") or {}).items()}
        value = value["reward"]
    elif isinstance(value, tuple) and len(value) == 2:
        value, raw_parts = value
        parts = {str(k): float(v) for k, v in raw_parts.items()}
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward is not finite: {reward}")
    return Reward(reward, parts)


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ for the block (a tool's or reward's declared variables)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

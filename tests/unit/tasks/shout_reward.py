"""A reward added in one file, as a new built-in one would be (tests/unit/tasks/test_registry.py).

One class, registered where it is defined: its fields are the run file's
options, `value` scores a completion in the verifier sandbox's child.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.tasks.registry import REWARDS, RewardPart


@REWARDS.register
class Shout(RewardPart):
    """1 if the completion is in capitals and at least `min_len` characters long."""

    fn: Literal["shout"]
    min_len: int = Field(1, ge=1, description="Shortest completion that counts.")

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        loud = completion.isupper() and len(completion) >= self.min_len
        return (1.0 if loud else 0.0), {}

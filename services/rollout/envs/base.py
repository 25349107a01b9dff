"""The environment protocol: single-turn (prompt -> completion -> reward) and multi-turn.

An environment owns two things: where problems come from (`problem(index)`,
pure and seeded, or a dataset), and how a finished completion is scored
(`verifier`, an import path run in the killable sandbox with
`verifier_args(...)`). Keeping the verifier an import path, not a bound
method, is what lets it run in another process.

A multi-turn environment also has `step(state, turn_text)`, a pure
function that returns the next state, the observation text to append
(tokens the policy did not produce, trained with loss mask 0) and whether
the episode is done. The loop that alternates generation and steps lives
in `multiturn.rollout_multi_turn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One prompt (text or chat messages) and the reference answer its verifier needs."""

    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    answer: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """What every environment provides."""

    name: str
    multi_turn: ClassVar[bool]
    verifier: str  # "pkg.module:function", called as function(*verifier_args(...))

    def problem(self, index: int) -> Problem:
        """The `index`-th problem (procedural envs: any index; datasets: wraps around)."""
        ...

    def verifier_args(self, completion: str, problem: Problem) -> tuple[Any, ...]:
        """Arguments of the verifier for this completion (picklable)."""
        ...


@dataclass(frozen=True)
class Turn:
    """What a multi-turn environment answers after one policy turn."""

    state: Any
    observation: str | None  # appended with loss mask 0; None when there is none
    done: bool


@runtime_checkable
class MultiTurnEnvironment(Environment, Protocol):
    max_turns: int
    stop: tuple[str, ...]  # stop strings that end one policy turn

    def initial_state(self, problem: Problem) -> Any: ...

    def step(self, state: Any, turn_text: str) -> Turn: ...

"""Multi-turn environments of the rollout tier (token-in, token-out episodes).

- `base`:       the protocol (single-turn and multi-turn) and `Problem`;
- `calculator`: a tool-use environment (the policy calls a calculator);
- `multiturn`:  the generate/observe loop of multi-turn environments.

Single-turn tasks — their data, prompt formatting, rewards and evaluation —
are the run file's task spec, shared by every service: services/common/tasks.
Verifiers of both run in its sandbox (`services.common.tasks.sandbox`).
"""

from __future__ import annotations

from services.rollout.envs.base import Environment, MultiTurnEnvironment, Problem, Turn

__all__ = ["Environment", "MultiTurnEnvironment", "Problem", "Turn"]

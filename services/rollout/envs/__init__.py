"""Environments and verifiers of the rollout tier.

- `base`:      the protocol (single-turn and multi-turn) and `Problem`;
- `builtin`:   arithmetic, JSONL datasets, the calculator tool, reasoning-gym;
- `verifiers`: exact match, math answers (math-verify or a fallback), arithmetic;
- `sandbox`:   `VerifierPool`, where every verifier call runs with a time
               limit in a process that is killed and replaced on a hang;
- `multiturn`: the generate/observe loop of multi-turn environments.

`make_env(name, **options)` builds an environment by the name a PromptTask
carries: "arithmetic", "jsonl", "calculator", "reasoning_gym:<task>"; a
custom verifier ("pkg.module:function") is the `verifier` option of
"arithmetic" or "jsonl". `score(pool, env, problem, completion)` runs the
environment's verifier in the pool.
"""

from __future__ import annotations

from typing import Any

from services.common.errors import ConfigError
from services.rollout.envs.base import Environment, MultiTurnEnvironment, Problem, Turn
from services.rollout.envs.sandbox import Reward, VerifierPool

__all__ = [
    "Environment",
    "MultiTurnEnvironment",
    "Problem",
    "Reward",
    "Turn",
    "VerifierPool",
    "make_env",
    "score",
]


def make_env(name: str, **options: Any) -> Environment:
    """The environment called `name`, built with `options`; ConfigError if unknown."""
    from services.rollout.envs import builtin

    try:
        if name == "arithmetic":
            return builtin.ArithmeticEnv(**options)
        if name == "jsonl":
            return builtin.JsonlEnv(**options)
        if name == "calculator":
            return builtin.CalculatorEnv(**options)
        if name.startswith("reasoning_gym:"):
            return builtin.ReasoningGymEnv(name.split(":", 1)[1], **options)
    except TypeError as e:
        raise ConfigError(f"environment {name!r}: bad options {sorted(options)}: {e}") from e
    raise ConfigError(
        f"unknown environment {name!r} (arithmetic, jsonl, calculator, reasoning_gym:<task>)"
    )


async def score(pool: VerifierPool, env: Environment, problem: Problem, completion: str) -> Reward:
    """Run `env`'s verifier on one completion, under the pool's time limit."""
    return await pool.call(env.verifier, *env.verifier_args(completion, problem))

"""Drive a multi-turn environment against an engine: generate, observe, repeat.

The response is one token sequence in which policy tokens (loss mask 1,
with the engine's logprobs) alternate with observation tokens the
environment appended (loss mask 0, logprob 0.0 as a placeholder the trainer
never uses). Each turn is one /generate on prompt + response-so-far, so the
trainer's recomputation over the same ids sees exactly what the engine saw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.engine_client import EngineClient
from services.rollout.envs.base import MultiTurnEnvironment, Problem


@dataclass
class Trajectory:
    """A finished multi-turn episode, ready to become a Sample."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    text: str = ""
    turns: int = 0
    finish_type: str = "stop"
    weight_versions: list[str] = field(default_factory=list)

    def add(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        """Append policy tokens (with logprobs, mask 1) or observation tokens (mask 0)."""
        self.response_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)
        self.text += text


async def rollout_multi_turn(
    env: MultiTurnEnvironment,
    client: EngineClient,
    encode: Callable[[str], list[int]],
    problem: Problem,
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    max_response_tokens: int,
    rid: str | None = None,
) -> Trajectory:
    """Run one episode; stops when the env is done, a turn is aborted or the budget is spent."""
    traj = Trajectory(prompt_ids=list(prompt_ids))
    state = env.initial_state(problem)
    # no_stop_trim: the text must match the ids, closing tag included, for the env to parse.
    params = {**sampling_params, "stop": list(env.stop), "no_stop_trim": True, "n": 1}
    for turn in range(env.max_turns):
        budget = max_response_tokens - len(traj.response_ids)
        if budget <= 0:
            traj.finish_type = "length"
            break
        turn_params = {
            **params,
            "max_new_tokens": min(budget, params.get("max_new_tokens", budget)),
        }
        [res] = await client.generate(
            traj.prompt_ids + traj.response_ids,
            sampling_params=turn_params,
            rid=f"{rid}:t{turn}" if rid else None,
        )
        traj.add(res.output_ids, res.logprobs, res.text)
        traj.turns += 1
        traj.weight_versions.append(res.weight_version)
        traj.finish_type = res.finish_type
        if res.aborted:
            break
        step = env.step(state, res.text)
        state = step.state
        if step.done or step.observation is None:
            break
        obs_ids = encode(step.observation)[: max_response_tokens - len(traj.response_ids)]
        traj.add(obs_ids, None, step.observation)
    return traj

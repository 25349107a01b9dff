"""A task's `n` multi-turn episodes through the engine (tasks with `[task.episode]`).

The loop itself is services.tasks.episode (shared with the
evaluation); this adapter gives it the engine: each turn is one /generate
of n = 1 on the ids so far, under a request id unique to this delivery,
sample and turn. A turn aborted by a weight update is generated again from
the same ids (its partial tokens are dropped, as a single-turn sample's
are), so an update never costs an episode. The finished episode becomes
the GenerateResult the single-turn path would have had, plus its loss mask.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from proto.weight_version import VersionSpan
from services.engine_api.engine_client import EngineClient, GenerateResult
from services.runtime.errors import RetryableError
from services.sandbox import ToolPool
from services.tasks.episode import Episode, TurnOutput, run_episode
from services.tasks.episode_spec import EpisodeSpec


def turn_output(r: GenerateResult) -> TurnOutput:
    spans = tuple((s.version, s.start, s.end) for s in r.weight_versions)
    return TurnOutput(r.output_ids, r.logprobs, r.text, r.finish_type, r.weight_version, spans)


def as_result(ep: Episode, rid: str) -> GenerateResult:
    """The episode as one completion: all its tokens, logprob 0.0 on observations."""
    spans = (
        tuple(VersionSpan(version=v, start=a, end=b) for v, a, b in ep.spans)
        if ep.all_spans and ep.spans and ep.spans[-1][2] == len(ep.response_ids)
        else ()
    )
    return GenerateResult(
        rid=rid,
        text=ep.text,
        output_ids=list(ep.response_ids),
        logprobs=list(ep.logprobs),
        finish_type=ep.finish_type,
        finish_reason={"type": ep.finish_type},
        prompt_tokens=len(ep.prompt_ids),
        completion_tokens=sum(ep.loss_mask),
        weight_version=ep.weight_version,
        e2e_latency=0.0,
        weight_versions=spans,
    )


class EpisodeRunner:
    """Runs the episodes of a task against one engine, with one tool sandbox."""

    def __init__(
        self,
        client: EngineClient,
        tools: ToolPool,
        encode: Callable[[str], list[int]],
        timeout_s: float,
        max_abort_retries: int,
        on_abort: Callable[[], Any],
    ) -> None:
        self.client = client
        self.tools = tools
        self.encode = encode
        self.timeout_s = timeout_s
        self.max_abort_retries = max_abort_retries
        self.on_abort = on_abort

    async def turn(
        self, ids: list[int], params: dict[str, Any], rid: str, lora_path: str | None = None
    ) -> TurnOutput:
        for attempt in range(self.max_abort_retries + 1):
            suffix = f":r{attempt}" if attempt else ""
            [r] = await self.client.generate(
                ids,
                sampling_params=params,
                rid=rid + suffix,
                timeout_s=self.timeout_s,
                lora_path=lora_path,
            )
            if not r.aborted:
                return turn_output(r)
            self.on_abort()
        raise RetryableError(f"{rid}: generation aborted {self.max_abort_retries + 1} times")

    async def episode(
        self,
        spec: EpisodeSpec,
        ids: list[int],
        params: dict[str, Any],
        rid: str,
        lora_path: str | None = None,
    ) -> Episode:
        async def generate(so_far: list[int], p: dict[str, Any], turn: int) -> TurnOutput:
            return await self.turn(so_far, p, f"{rid}:t{turn}", lora_path)

        return await run_episode(spec, generate, self.tools, self.encode, ids, params)

    async def run(
        self,
        spec: EpisodeSpec,
        ids: list[int],
        params: dict[str, Any],
        rid: str,
        n: int,
        lora_path: str | None = None,
    ) -> list[Episode]:
        """`n` episodes of one prompt, at once (the engine batches their turns), with LoRA
        adapter `lora_path` (None: the engine's own weights)."""
        one = {**params, "n": 1}
        eps = (self.episode(spec, ids, one, f"{rid}:s{i}", lora_path) for i in range(n))
        return list(await asyncio.gather(*eps))

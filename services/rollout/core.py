"""The rollout worker's pure core: request ids, sampling parameters, versions, samples.

No I/O here: the worker (worker.py) talks to the engine, the verifier pool
and NATS, and hands what they answered to these functions, which decide
what a delivery's request id is, what an engine error means for the task,
which weight versions a completion's tokens came from, and what the
published `Sample`s and `SampleGroup` hold. Also which of the versions a
worker keeps beside its engine may go (`prunable`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from proto.messages import (
    FinishReason,
    PromptTask,
    Sample,
    SampleGroup,
    pack_f32,
    pack_i32,
    pack_u8,
)
from proto.weight_version import VersionSpan
from services.engine_api.engine_client import EngineError, EngineHTTPError, GenerateResult
from services.runtime.errors import PermanentError, RetryableError
from services.sandbox import Reward


def request_id(task: PromptTask, delivered: int) -> str:
    """The engine request id of one delivery of a task: never one still in flight.

    SGLang (0.5.10+) answers 400 "Duplicate request ID" to an id in flight,
    and a task can be delivered again while its first generation still runs
    (the worker that had it died, or it outlived the ack wait). The delivery
    count says which delivery it was; the random part keeps two workers apart.
    """
    return f"{task.task_id}:a{task.attempt}:d{delivered}:{uuid.uuid4().hex[:8]}"


def engine_failure(e: EngineError, url: str, task_id: str) -> PermanentError | RetryableError:
    """A 400 from /generate is the engine refusing the request itself (a bad top_k, a
    prompt too long): dead-letter it with the engine's words. Anything else may pass."""
    if isinstance(e, EngineHTTPError) and e.status == 400 and e.url.endswith("/generate"):
        why = f"engine {url} refused task {task_id}: {e.message}"
        return PermanentError(why, reason="engine_rejected")
    return RetryableError(f"engine {url}: {e}")


def sampling_params(task: PromptTask, n: int) -> dict[str, Any]:
    """SGLang's `sampling_params` for `n` completions of `task`."""
    sp = task.sampling
    params: dict[str, Any] = {
        "n": n,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "max_new_tokens": sp.max_new_tokens,
    }
    if sp.stop:
        params["stop"] = list(sp.stop)
    return params


def sample_versions(r: GenerateResult, before: int) -> tuple[int, int, tuple[VersionSpan, ...]]:
    """(first, last, spans) of one completion's weight versions.

    SGLang >= 0.5.19 says which tokens came from which version (a pause
    during an update can split a completion); older engines say only the
    version at completion, so the first is bounded from below by `before`,
    the version the engine served when the task began.
    """
    spans = r.weight_versions
    if spans:
        return spans[0].version, spans[-1].version, spans
    last = r.weight_version
    return min(before, last), last, ()


def adapter_made(r: GenerateResult, version: int) -> GenerateResult:
    """`r`, made with the adapter of `version` from start to end (a request keeps its
    adapter): the engine's own weight_version is its base's, not what sampled."""
    return replace(r, weight_version=version, weight_versions=())


@dataclass(frozen=True)
class Origin:
    """Where and when a task's completions were made."""

    engine_id: str
    before: int  # the version the engine served when the task began
    started: float  # when generation started


def make_sample(
    task: PromptTask,
    group_id: str,
    i: int,
    prompt_ids: list[int],
    r: GenerateResult,
    score: Reward,
    origin: Origin,
    loss_mask: list[int] | None = None,
) -> Sample:
    """Completion `i` of a task, scored, as the wire's Sample (an episode: with its
    loss mask, 0 on observation tokens; a single completion: 1 everywhere)."""
    first, last, spans = sample_versions(r, origin.before)
    return Sample(
        sample_id=f"{group_id}:s{i}",
        group_id=group_id,
        task_id=task.task_id,
        index=i,
        attempt=task.attempt,
        prompt_ids=pack_i32(prompt_ids),
        response_ids=pack_i32(r.output_ids),
        logprobs=pack_f32(r.logprobs),
        loss_mask=pack_u8(loss_mask if loss_mask is not None else [1] * len(r.output_ids)),
        reward=score.reward,
        reward_parts=dict(score.parts),
        finish_reason=FinishReason(r.finish_type),
        weight_version=first,
        weight_version_last=last,
        weight_version_spans=spans,
        engine_id=origin.engine_id,
        queued_at=task.created_at,
        started_at=origin.started,
        finished_at=time.time(),
        verifier_error=score.error,
    )


def make_group(
    run: str, task: PromptTask, group_id: str, samples: tuple[Sample, ...], worker_id: str
) -> SampleGroup:
    """A task's samples as the group the buffer receives."""
    return SampleGroup(
        run=run,
        group_id=group_id,
        task_id=task.task_id,
        task_name=task.task_name,
        worker_id=worker_id,
        samples=samples,
        temperature=task.sampling.temperature or 1.0,
        created_at=time.time(),
    )


def prunable(held: list[int], serving: int, keep: int) -> list[int]:
    """Local versions to delete: older than both the served one and the newest `keep`."""
    if not held:
        return []
    floor = min(serving, sorted(held)[-keep] if len(held) >= keep else min(held))
    return [v for v in held if v < floor]

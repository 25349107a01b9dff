"""Held-out evaluation on an engine the run already has, tied to the version it measures.

The trainer used to load a second copy of the model and generate with Hugging
Face `generate` beside its steps: trainer memory on a GPU, a busy thread on a
CPU, and a result minutes late. Generation is what the engines are for, so the
one evaluation function (evaluate.py) takes its completions from an engine
through the SGLang API instead (`engine_complete`), and scores them exactly as
before (the task's reward in the verifier sandbox).

A figure must be of one version: every response's `weight_version` (and its
per-token spans, where the release reports them) is checked against the
version evaluated, and one answer from another version, or one aborted by a
weight update, ends the evaluation with `EvalAborted` naming it; a figure
never mixes versions. (Sync holds the engine at that version while it
evaluates, services/sync/evaluating.py, so this is the guard, not the plan.)

`figures` and `report_of` turn an `EvalReport` into the wire's `EvalResult`
tasks and back, so whoever records the result (the trainer's metrics rows,
best weights, gauges) reads the same report the in-process path gives.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proto.messages import EvalResult, TaskEvalResult
from services.engine_api.engine_client import EngineClient, GenerateResult
from services.runtime.errors import FlywheelError
from services.tasks.evaluate import Complete, Completions, EvalReport, TaskEval


class EvalAborted(FlywheelError, RuntimeError):
    """An evaluation on an engine could not finish on the version it measures."""


def checked(r: GenerateResult, version: int, url: str, adapter: bool = False) -> GenerateResult:
    """`r`, if version `version` generated all of it; EvalAborted naming what did otherwise.
    `adapter`: sampled with the version's LoRA adapter named in the request, which is what
    pins the version (the engine's own `weight_version` is its base model's)."""
    if r.aborted:
        raise EvalAborted(f"an answer was aborted by engine {url}: {r.finish_reason}")
    if adapter:
        return r
    others = {s.version for s in r.weight_versions} | {r.weight_version}
    if others != {version}:
        got = ", ".join(f"v{v}" for v in sorted(others))
        raise EvalAborted(f"engine {url} answered with {got} while v{version} was evaluated")
    return r


def engine_complete(
    client: EngineClient,
    tokenizer: Any,
    version: int,
    *,
    concurrency: int = 32,
    timeout_s: float | None = None,
    lora_path: str | None = None,
) -> Complete:
    """evaluate.py's `Complete` through `client`'s engine: one /generate per prompt (n = k),
    at most `concurrency` in flight (the engine batches them), each answer checked to be of
    `version`. Greedy is temperature 0 (SGLang: top_k 1); samples have no top-k/top-p
    truncation, as the in-process path. `lora_path`: the version is the LoRA adapter loaded
    under that name (`proto.weight_version.adapter_name`), sampled with it."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ids: list[int], k: int, temperature: float, max_new_tokens: int) -> Any:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": k}
        if k == 1:
            params["temperature"] = 0.0
        else:
            params |= {"temperature": temperature, "top_p": 1.0, "top_k": -1}
        async with gate:
            results = await client.generate(
                ids,
                sampling_params=params,
                return_logprob=False,
                timeout_s=timeout_s,
                lora_path=lora_path,
            )
        adapter = lora_path is not None
        return [
            (tokenizer.decode(r.output_ids, skip_special_tokens=True), len(r.output_ids))
            for r in (checked(r, version, client.url, adapter) for r in results)
        ]

    async def complete(
        ids: list[list[int]],
        *,
        max_new_tokens: int,
        k: int = 1,
        temperature: float = 1.0,
        seed: int = 0,  # an engine samples from its own seed: pass@k is not reproducible
    ) -> Completions:
        return list(await asyncio.gather(*(one(p, k, temperature, max_new_tokens) for p in ids)))

    return complete


def figures(report: EvalReport) -> tuple[TaskEvalResult, ...]:
    """A report's per-task figures, as an EvalResult carries them."""
    return tuple(
        TaskEvalResult(
            name=name,
            total=t.total,
            pass_at_1=t.pass_at_1,
            mean_reward=t.mean_reward,
            k=t.k,
            pass_at_k=t.pass_at_k,
        )
        for name, t in report.tasks.items()
    )


def report_of(result: EvalResult) -> EvalReport:
    """The report an evaluated EvalResult stands for (no example answers: not on the wire)."""
    return EvalReport(
        {
            t.name: TaskEval(t.total, t.pass_at_1, t.mean_reward, t.k, t.pass_at_k)
            for t in result.tasks
        },
        result.split,
    )

"""Wiring of the rollout worker: engine client, tokenizer, environments, loops."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from proto.messages import PromptTask
from proto.streams import consumers_for
from services.common.engine_client import EngineClient
from services.common.errors import ConfigError
from services.common.lifecycle import ServiceContext
from services.rollout.envs import Environment, Problem, Reward, VerifierPool, make_env, score
from services.rollout.settings import RolloutSettings
from services.rollout.weights_fetch import WeightsFetcher
from services.rollout.worker import RolloutWorker


def load_tokenizer(model: Path | None) -> Any:
    from transformers import AutoTokenizer

    if model is None or not (model / "tokenizer_config.json").is_file():
        raise ConfigError(f"[rollout] model: no tokenizer in {model} (set the engine's model dir)")
    return AutoTokenizer.from_pretrained(model, local_files_only=True)


class EnvScorer:
    """Environments by the name tasks carry, built once; verifiers run in the pool."""

    def __init__(self, pool: VerifierPool) -> None:
        self.pool = pool
        self.envs: dict[str, Environment] = {}

    async def __call__(self, task: PromptTask, text: str) -> Reward:
        env = self.envs.get(task.env)
        if env is None:
            env = self.envs[task.env] = make_env(task.env)
        problem = Problem(prompt=task.prompt, messages=task.messages, answer=task.answer)
        return await score(self.pool, env, problem, text)


async def body(ctx: ServiceContext) -> None:
    s = ctx.settings
    assert isinstance(s, RolloutSettings)
    tokenizer = await asyncio.to_thread(load_tokenizer, s.model)
    async with (
        EngineClient(
            s.engine_url,
            timeout_s=s.generate_timeout_s,
            api_key=s.engine_api_key.get_secret_value() if s.engine_api_key else None,
        ) as c,
        VerifierPool(size=2, timeout_s=s.verifier_timeout_s) as pool,
    ):
        worker = RolloutWorker(ctx, s, c, tokenizer, EnvScorer(pool))
        worker.fetcher = WeightsFetcher(
            ctx.js, ctx.nc, s.run, s.weights_dir / s.run / s.engine_id, poll_s=s.weights_poll_s,
            keep=s.weights_keep, idle_timeout_s=s.weights_idle_timeout_s,
            on_download=worker.metrics.downloaded,
        )  # fmt: skip
        ctx.readiness.set("engine", "not checked yet")
        await worker.wait_for_engine(ctx.stop)  # its SGLang release decides the routes
        heartbeat = asyncio.create_task(worker.heartbeat_loop(ctx.stop))
        fetch = asyncio.create_task(worker.fetcher.run_loop(ctx.stop, worker.engine_version))
        try:
            await ctx.consume(
                consumers_for(s.run)["rollout"], PromptTask, worker.on_task,
                concurrency=s.concurrency, batch=s.concurrency,
            )  # fmt: skip
        finally:
            await heartbeat
            await fetch

"""Wiring of the rollout worker: engine client, tokenizer, the task's rewards, loops."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from proto.messages import PromptTask
from proto.streams import consumers_for
from services.engine_api.engine_client import EngineClient
from services.engine_api.teacher import TeacherPool
from services.rollout.settings import RolloutSettings
from services.rollout.weights_fetch import WeightsFetcher
from services.rollout.worker import RolloutWorker
from services.runtime.errors import ConfigError
from services.runtime.lifecycle import ServiceContext
from services.sandbox import Reward, ToolPool
from services.tasks import judge as judging
from services.tasks.episode_spec import EpisodeSpec
from services.tasks.judge_pool import judge_over
from services.tasks.prompts import readable
from services.tasks.scoring import Scorer, tool_pool, verifier_pool
from services.tasks.taskset import TaskSet
from services.tasks.verifiers_v1 import VerifiersV1Source


def load_tokenizer(model: Path | None) -> Any:
    from transformers import AutoTokenizer

    from services.models.resolve import resolve_model

    if model is None:
        raise ConfigError("[rollout] model: not set (the engine's model)")
    path = resolve_model(model, key="[rollout] model")
    if not (path / "tokenizer_config.json").is_file():
        raise ConfigError(f"[rollout] model: no tokenizer in {path} (set the engine's model)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class PromptTaskScorer:
    """The worker's view of the run's tasks (worker.PromptTaskScoring): how to render a
    PromptTask's prompt and score its completions, through the tasks domain's `Scorer`.

    Resolved by the task's name (PromptTask.task_name) from this worker's own
    run file; a name it does not know is a PermanentError (`unknown_task`).
    """

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def chat_template(self, task: PromptTask) -> bool:
        return self.scorer.chat_template(task.task_name)

    def episode(self, task: PromptTask) -> EpisodeSpec | None:
        return self.scorer.spec(task.task_name).episode

    def verifiers_v1(self, task: PromptTask) -> VerifiersV1Source | None:
        src = self.scorer.spec(task.task_name).source
        return src if isinstance(src, VerifiersV1Source) else None

    async def score_group(
        self, task: PromptTask, completions: list[tuple[str, int]]
    ) -> list[Reward]:
        return await self.scorer.score_group(
            task.task_name,
            task.index,
            task.answer,
            completions,
            prompt=readable(task.prompt, task.messages),
        )


@contextlib.asynccontextmanager
async def judge_for(s: RolloutSettings, ctx: ServiceContext) -> AsyncIterator[judging.Judge | None]:
    """The LLM judge over the [judge] engines, if a task has a judge part; its metrics
    (`flywheel_judge_*`) in this worker's registry."""
    if not s.judged():
        yield None
        return
    metrics = judging.JudgeMetrics(ctx.registry)
    async with judge_over(s.judge, s.judge_urls(), metrics) as judge:
        yield judge


@contextlib.asynccontextmanager
async def teacher_for(s: RolloutSettings) -> AsyncIterator[TeacherPool | None]:
    """The teacher's engines ([teacher] urls and those `flywheel up` started), if any."""
    if s.teacher is None:
        yield None
        return
    urls = [*s.teacher_urls, *s.teacher.urls]
    if not urls:
        raise ConfigError("[teacher]: no engines (set urls, or start them with flywheel up)")
    async with TeacherPool(s.teacher, urls) as pool:
        yield pool


@contextlib.asynccontextmanager
async def tools_for(tasks: TaskSet, remote: Path | None) -> AsyncIterator[ToolPool | None]:
    """The tool sandbox, if a task has episodes."""
    pool = tool_pool(tasks, remote)
    if pool is None:
        yield None
        return
    async with pool:
        yield pool


async def body(ctx: ServiceContext) -> None:
    s = ctx.settings
    assert isinstance(s, RolloutSettings)
    tasks = s.task_set()
    tasks.check(data=False)  # rewards and their packages; a worker needs no data
    tokenizer = await asyncio.to_thread(load_tokenizer, s.model)
    async with (
        EngineClient(
            s.engine_url,
            timeout_s=s.generate_timeout_s,
            api_key=s.engine_api_key.get_secret_value() if s.engine_api_key else None,
        ) as c,
        # warm-up: the rewards import in every sandbox child first, or exit 2 now
        verifier_pool(tasks, timeout_s=s.verifier_timeout_s, remote=s.sandbox_socket) as pool,
        tools_for(tasks, s.sandbox_socket) as tools,
        judge_for(s, ctx) as judge,
        teacher_for(s) as teacher,
    ):
        scorer = PromptTaskScorer(Scorer(tasks, pool, judge=judge))
        worker = RolloutWorker(ctx, s, c, tokenizer, scorer)
        if tools is not None:
            worker.use_tools(tools)
        if teacher is not None:
            worker.teacher = teacher
        worker.fetcher = WeightsFetcher(
            ctx.js,
            ctx.nc,
            s.run,
            s.weights_dir / s.run / s.engine_id,
            poll_s=s.weights_poll_s,
            keep=s.weights_keep,
            idle_timeout_s=s.weights_idle_timeout_s,
            max_attempts=s.weights_fetch_attempts,
            on_download=worker.metrics.downloaded,
            on_give_up=worker.metrics.given_up,
        )
        ctx.readiness.set("engine", "not checked yet")
        await worker.wait_for_engine(ctx.stop)  # its SGLang release decides the routes
        heartbeat = asyncio.create_task(worker.heartbeat_loop(ctx.stop))
        fetch = asyncio.create_task(worker.fetcher.run_loop(ctx.stop, worker.engine_version))
        lending = asyncio.create_task(worker.lending.run(ctx.stop))  # [rollout.cores]
        for side in (heartbeat, fetch, lending):  # one that fails stops the worker
            side.add_done_callback(functools.partial(_stop_on_error, ctx.stop))
        try:
            await ctx.consume(
                consumers_for(s.run)["rollout"],
                PromptTask,
                worker.on_task,
                concurrency=s.concurrency,
                batch=s.concurrency,
            )
        finally:
            await worker.close()
            await heartbeat
            await fetch
            await lending


def _stop_on_error(stop: asyncio.Event, task: asyncio.Task[None]) -> None:
    """A side loop that ended with an error stops the worker (the error is raised on exit)."""
    if not task.cancelled() and task.exception() is not None:
        stop.set()

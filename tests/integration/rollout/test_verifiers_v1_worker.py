"""A rollout worker on a verifiers v1 multi-turn env, with a real CPU engine and nats-server
(extra: verifiers>=0.3.1; skipped without it).

The worker takes PromptTasks of a `verifiers-v1` task off NATS, runs the
env's episodes through the engine's /v1/chat/completions (V1Runner) and
publishes one SampleGroup per task: each sample is one episode's tokens,
the env's turns masked out, the engine's logprobs on the policy's tokens,
the env's reward and parts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from prometheus_client import CollectorRegistry

from proto.codec import decode, encode, message_id
from proto.messages import (
    PromptTask,
    SampleGroup,
    SamplingParams,
    unpack_f32,
    unpack_i32,
    unpack_u8,
)
from proto.streams import streams_for
from proto.subjects import Subjects
from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.rollout.app import body as rollout_body
from services.rollout.settings import RolloutSettings
from services.runtime.lifecycle import run_service
from services.runtime.nats_conn import ensure_streams
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer
from tests.harness import REPO
from tests.harness.engines import EngineStates, serving_engine
from tests.harness.extras import require_verifiers_v1

require_verifiers_v1()

TASK = {
    "source": {"type": "verifiers-v1", "taskset": "fw-recall-v1", "args": {"num_tasks": 3}},
    "sandbox": "insecure-allow",  # a v1 env scores in the worker's process
}
NAME = "verifiers-v1:fw-recall-v1"


@pytest.fixture(autouse=True)
def _envs_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures" / "verifiers_v1"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("vf") / "m", TinyModelSpec())


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[EngineStates]:
    states = EngineStates(model_dir)
    yield states
    states.close()


def task(run: str, i: int) -> PromptTask:
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    return PromptTask(run=run, task_id=f"{run}:e0:i{i}", epoch=0, index=i, task_name=NAME,
                      prompt="(verifiers task)", n=2, sampling=sp)  # fmt: skip


@asynccontextmanager
async def worker(
    nats_url: str, run: str, engine_url: str, model_dir: Path
) -> AsyncIterator[tuple[Any, list[SampleGroup]]]:
    settings = RolloutSettings(
        run=run, nats=NatsSettings(url=nats_url, connect_attempts=3), engine_url=engine_url,
        task=TASK, engine_id="engine-0", worker_id="rollout-0", model=model_dir,
        concurrency=2, heartbeat_s=0.2, weights_dir=model_dir.parent / "engine-weights",
    )  # fmt: skip
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(run))
    groups: list[SampleGroup] = []

    async def on_group(msg: Any) -> None:
        groups.append(decode(msg.data, SampleGroup))

    await nc.subscribe(Subjects(run).samples, cb=on_group)
    stop = asyncio.Event()
    reg = CollectorRegistry()
    service = asyncio.create_task(run_service("rollout", settings, rollout_body, stop=stop,
                                              registry=reg, handle_signals=False))  # fmt: skip
    try:
        yield js, groups
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
        await nc.close()


def test_the_worker_publishes_one_sample_per_episode(
    nats_server: NatsServer, engines: EngineStates, model_dir: Path, run_async: Any
) -> None:
    async def body() -> list[SampleGroup]:
        async with serving_engine(engines.get()) as url, \
                worker(nats_server.url, "vf", url, model_dir) as (js, groups):  # fmt: skip
            for i in (0, 2):
                t = task("vf", i)
                await js.publish(Subjects("vf").tasks, encode(t),
                                 headers={"Nats-Msg-Id": message_id(t)})  # fmt: skip
            deadline = asyncio.get_running_loop().time() + 90
            while len(groups) < 2:
                assert asyncio.get_running_loop().time() < deadline, "no groups"
                await asyncio.sleep(0.05)
            return groups

    groups = run_async(body(), timeout_s=120)
    assert sorted(g.task_id for g in groups) == ["vf:e0:i0", "vf:e0:i2"]
    for g in groups:
        assert len(g.samples) == 2
        for s in g.samples:
            mask = unpack_u8(s.loss_mask).tolist()
            lps = unpack_f32(s.logprobs).tolist()
            assert len(unpack_i32(s.response_ids)) == len(mask) == len(lps)
            runs = [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]
            assert runs == [1, 0, 1, 0, 1]  # three turns, the env's two asks masked
            assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
            assert s.reward_parts["episode.turns"] == 3.0
            assert s.reward == s.reward_parts["verifiers.repeated"]
            assert len(unpack_i32(s.prompt_ids)) > 0 and s.verifier_error is None

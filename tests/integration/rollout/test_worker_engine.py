"""The rollout worker against a real CPU engine (answering as SGLang) and a real nats-server.

The worker runs in this process (`run_service` with the rollout body), the
engine too (its scheduler thread, aiohttp on a free port), so each test
costs a model load rather than a stack start-up. The test plays the buffer:
it publishes PromptTasks and reads what the worker publishes.

- a redelivered task, its first generation still running, gets a new request
  id: SGLang (0.5.10+) answers 400 to an id in flight;
- a 400 from /generate (SGLang refusing `top_k = 0`) is dead-lettered once,
  with the engine's message, and the worker goes on;
- a generation aborted mid-way is generated again, and the group is whole;
- tokens generated across an in-place weight update carry both versions;
- an engine that answers as SGLang 0.5.4 (the older routes) is served, and one
  outside the supported range stops the worker with the version named.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proto.codec import decode, encode, message_id
from proto.messages import DeadLetter, PromptTask, SampleGroup, SamplingParams
from proto.streams import streams_for
from proto.subjects import Subjects
from services.engine_api.engine_client import EngineClient
from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.rollout.app import body as rollout_body
from services.rollout.settings import RolloutSettings
from services.runtime.errors import ConfigError
from services.runtime.lifecycle import run_service
from services.runtime.nats_conn import ensure_streams
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer
from services.weights import write_weights_dir
from tests.harness.engines import EngineStates, serving, serving_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("worker") / "model", TinyModelSpec())


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[EngineStates]:
    """One engine state per emulated SGLang release, made on demand."""
    states = EngineStates(model_dir)
    yield states
    states.close()


def task(run: str, i: int, n: int = 2, **sampling: Any) -> PromptTask:
    sp = SamplingParams(**{"max_new_tokens": 4, **sampling})
    return PromptTask(run=run, task_id=f"{run}:e0:i{i}", epoch=0, index=i, task_name="arithmetic",
                      prompt="1+2=", answer="3", n=n, sampling=sp)  # fmt: skip


def rollout_settings(nats_url: str, run: str, engine_url: str, model_dir: Path) -> RolloutSettings:
    return RolloutSettings(
        run=run, nats=NatsSettings(url=nats_url, connect_attempts=3), engine_url=engine_url,
        task={"source": {"type": "arithmetic"}}, engine_id="engine-0", worker_id="rollout-0",
        model=model_dir, concurrency=2,
        heartbeat_s=0.2, weights_dir=model_dir.parent / "engine-weights",
    )  # fmt: skip


@asynccontextmanager
async def worker(
    nats_url: str, run: str, engine_url: str, model_dir: Path, registry: CollectorRegistry
) -> AsyncIterator[tuple[Any, dict[str, list[Any]]]]:
    """The rollout service in this process, and what it publishes (groups, dead letters)."""
    settings = rollout_settings(nats_url, run, engine_url, model_dir)
    s = Subjects(run)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(run))
    seen: dict[str, list[Any]] = {"groups": [], "dead": [], "beats": []}

    async def on_group(msg: Any) -> None:
        seen["groups"].append(decode(msg.data, SampleGroup))

    async def on_dead(msg: Any) -> None:
        seen["dead"].append(decode(msg.data, DeadLetter))

    async def on_beat(msg: Any) -> None:
        seen["beats"].append(msg.data)

    await nc.subscribe(s.samples, cb=on_group)
    await nc.subscribe(s.dlq_all, cb=on_dead)
    await nc.subscribe(s.heartbeats_all, cb=on_beat)
    stop = asyncio.Event()
    service = asyncio.create_task(run_service("rollout", settings, rollout_body, stop=stop,
                                              registry=registry, handle_signals=False))  # fmt: skip
    try:
        yield js, seen
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
        await nc.close()


async def publish(js: Any, t: PromptTask) -> None:
    await js.publish(Subjects(t.run).tasks, encode(t), headers={"Nats-Msg-Id": message_id(t)})


async def until(check: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {check}"
        await asyncio.sleep(0.05)


def metric(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name) or 0.0


def test_engine_refusal_is_dead_lettered_with_its_message_once(
    nats_server: NatsServer, engines: EngineStates, model_dir: Path, run_async: Any
) -> None:
    """SGLang answers 400 to top_k = 0 (the proto allows it): permanent, not retried."""
    state = engines.get()

    async def body() -> None:
        reg = CollectorRegistry()
        async with serving_engine(state) as url, \
                worker(nats_server.url, "refuse", url, model_dir, reg) as (js, seen):  # fmt: skip
            await publish(js, task("refuse", 0, top_k=0, temperature=1.0))
            await until(lambda: seen["dead"])
            await publish(js, task("refuse", 1))  # the worker goes on
            await until(lambda: seen["groups"])
        [dead] = seen["dead"]
        assert dead.reason == "engine_rejected" and dead.delivered == 1
        assert "top_k must be -1 (disable) or at least 1, got 0." in dead.error
        assert [g.task_id for g in seen["groups"]] == ["refuse:e0:i1"]

    run_async(body(), timeout_s=90)


def test_aborted_generations_are_generated_again(
    nats_server: NatsServer, engines: EngineStates, model_dir: Path, run_async: Any
) -> None:
    state = engines.get()

    async def body() -> None:
        reg = CollectorRegistry()
        async with serving_engine(state) as url, EngineClient(url) as admin, \
                worker(nats_server.url, "regen", url, model_dir, reg) as (js, seen):  # fmt: skip
            await admin.request("POST", "/slow_down", {"forward_sleep_time": 0.05})
            try:
                await publish(js, task("regen", 0, n=2, max_new_tokens=40))
                await until(lambda: state.scheduler.load()["num_running_reqs"] >= 1)
                await admin.abort_request(abort_all=True)
            finally:
                await admin.request("POST", "/slow_down", {"forward_sleep_time": None})
            await until(lambda: seen["groups"])
        [group] = seen["groups"]
        assert len(group.samples) == 2 and all(s.finish_reason != "abort" for s in group.samples)
        assert metric(reg, "flywheel_rollout_aborted_generations_total") >= 1

    run_async(body(), timeout_s=90)


def test_a_redelivered_task_does_not_reuse_a_request_id_in_flight(
    engines: EngineStates, model_dir: Path, run_async: Any
) -> None:
    """Two deliveries of one task on one engine at once: both generate (no 400)."""
    from services.rollout.worker import RolloutWorker

    state = engines.get()

    class Delivered:  # what generate() reads of a JetStream delivery
        def __init__(self, n: int) -> None:
            self.delivered = n

        async def in_progress(self) -> None:
            return None

    class Ctx:  # the worker's metrics registry; generate() publishes nothing
        registry = CollectorRegistry()
        js = None  # its dead-letter publisher is made, never used here
        max_payload = 1 << 20

    async def body() -> None:
        async with serving_engine(state) as url, EngineClient(url) as c:
            settings = RolloutSettings(
                engine_url=url, model=model_dir, task={"source": {"type": "arithmetic"}}
            )
            w = RolloutWorker(Ctx(), settings, c, None, None)  # type: ignore[arg-type]
            t = task("dup", 0, n=1, max_new_tokens=30)
            await c.request("POST", "/slow_down", {"forward_sleep_time": 0.02})
            try:
                first = asyncio.create_task(w.generate(t, [4, 5, 6], Delivered(1)))  # type: ignore[arg-type]
                await until(lambda: state.scheduler.load()["num_running_reqs"] >= 1)
                again = await w.generate(t, [4, 5, 6], Delivered(2))  # type: ignore[arg-type]
            finally:
                await c.request("POST", "/slow_down", {"forward_sleep_time": None})
            done = await first
        assert len(done) == len(again) == 1 and done[0].rid != again[0].rid

    run_async(body(), timeout_s=60)


def test_tokens_across_an_in_place_update_carry_both_versions(
    nats_server: NatsServer, engines: EngineStates, model_dir: Path, tmp_path: Path,
    run_async: Any,
) -> None:  # fmt: skip
    state = engines.get()
    v1 = tmp_path / "v1"
    write_weights_dir(v1, lambda d: write_tiny_model(d, TinyModelSpec(seed=1)))

    async def body() -> None:
        reg = CollectorRegistry()
        async with serving_engine(state) as url, EngineClient(url) as admin, \
                worker(nats_server.url, "spans", url, model_dir, reg) as (js, seen):  # fmt: skip
            await admin.request("POST", "/slow_down", {"forward_sleep_time": 0.05})
            try:
                await publish(js, task("spans", 0, n=1, max_new_tokens=40, temperature=1.0))
                await until(lambda: state.scheduler.load()["num_running_reqs"] >= 1)
                await until(lambda: state.scheduler.generated_tokens >= 3)
                await admin.pause_generation("in_place")
                res = await admin.update_weights_from_disk(str(v1), 1, update_mode="in_place")
                assert res.success, res.message
            finally:
                await admin.request("POST", "/slow_down", {"forward_sleep_time": None})
                await admin.continue_generation()
            await until(lambda: seen["groups"])
        [sample] = seen["groups"][0].samples
        spans = sample.weight_version_spans
        n = sample.num_response_tokens
        if n == spans[0].end:  # it stopped (EOS) before the update: one span is right too
            pytest.skip("the completion ended before the update")
        assert [s.version for s in spans] == [0, 1] and spans[-1].end == n
        assert (sample.weight_version, sample.weight_version_last) == (0, 1)

    run_async(body(), timeout_s=90)


def test_a_0_5_4_engine_is_served_through_its_older_routes(
    nats_server: NatsServer, engines: EngineStates, model_dir: Path, run_async: Any
) -> None:
    """0.5.4 has no /model_info, /v1/loads: the worker used to retry every task forever."""
    state = engines.get(sglang_version="0.5.4")

    async def body() -> None:
        reg = CollectorRegistry()
        async with serving_engine(state) as url, \
                worker(nats_server.url, "old", url, model_dir, reg) as (js, seen):  # fmt: skip
            await publish(js, task("old", 0))
            await until(lambda: seen["groups"] and seen["beats"])
        [group] = seen["groups"]
        assert all(s.weight_version_spans == () for s in group.samples)  # 0.5.4 reports none

    run_async(body(), timeout_s=90)


def test_an_unsupported_release_stops_the_worker_naming_it(
    nats_server: NatsServer, model_dir: Path, run_async: Any
) -> None:
    async def server_info(_r: web.Request) -> web.Response:
        return web.json_response({"version": "0.4.10.post2"})

    app = web.Application()
    app.router.add_get("/server_info", server_info)

    async def body() -> None:
        async with serving(app) as url:
            settings = rollout_settings(nats_server.url, "unsupported", url, model_dir)
            service = run_service("rollout", settings, rollout_body, stop=asyncio.Event(),
                                  registry=CollectorRegistry(), handle_signals=False)  # fmt: skip
            with pytest.raises(ConfigError, match=r"SGLang 0\.4\.10\.post2.*>=0\.5\.4,<0\.6"):
                await asyncio.wait_for(service, 30)  # it ends by itself, with the error

    run_async(body(), timeout_s=60)

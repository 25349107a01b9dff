"""Sync's engine update against real CPU engines answering as given SGLang releases.

One update = pause (as `update_mode` says) → update_weights_from_disk →
continue, with a request in flight. What it must get right, per release:

- the API key (SGLang guards every path but /health*, /ready*);
- `flush_cache`: in_place never flushes (0.5.22+ answers 400, 0.5.6-0.5.21's
  scheduler died asserting), retract flushes only from 0.5.22 (a paused
  flush ignores the retracted requests there, and failed before);
- a mode the release cannot do (retract before 0.5.6, whose
  /pause_generation always aborts) is refused naming the release, before
  anything is paused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from services.engine.app import build_app, create_state
from services.engine.settings import EngineSettings
from services.engine_api.engine_client import (
    EngineClient,
    EngineError,
    EngineHTTPError,
    GenerateResult,
)
from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.runtime.errors import ConfigError
from services.runtime.settings import load_settings
from services.sync.app import SyncService
from services.sync.core import Engine, Published
from services.sync.settings import SyncSettings
from services.weights import SharedDir, write_weights_dir
from tests.harness.engines import EngineStates

KEY = "sync-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("sync") / "model", TinyModelSpec())


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sync") / "v1"
    write_weights_dir(out, lambda d: write_tiny_model(d, TinyModelSpec(seed=1)))
    return out


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[Any]:
    states = EngineStates(model_dir, api_key=KEY)
    yield lambda version: states.get(sglang_version=version)
    states.close()


class Ctx:
    """What SyncService reads of its service context: the metrics registry (and, for its
    weights transports, NATS: no update here needs it)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.js = None
        self.max_payload = 1024 * 1024


async def update_with_request_in_flight(
    state: Any, mode: str, weights: Path, *, key: str | None = KEY
) -> tuple[SyncService, Engine, GenerateResult | BaseException]:
    """Serve the engine, start a long request, run sync's update of it to the next version.

    Engines are shared by the module: each update goes one version up from where
    the engine is (`engine.version` says where it ended).
    """
    v = int(state.scheduler.served_version)
    runner = web.AppRunner(build_app(state), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with EngineClient(url, api_key=KEY) as c:
            await c.request("POST", "/slow_down", {"forward_sleep_time": 0.05})
            params = {"max_new_tokens": 60, "ignore_eos": True}
            flight = asyncio.create_task(c.generate([4, 5, 6], sampling_params=params))
            deadline = time.monotonic() + 20
            while state.scheduler.generated_tokens < 3 or (await c.loads()).running < 1:
                assert time.monotonic() < deadline, "the request never started"
                await asyncio.sleep(0.02)
            settings = SyncSettings(update_mode=mode, engine_api_key=key, update_timeout_s=30)
            svc = SyncService(Ctx(), settings)  # type: ignore[arg-type]
            engine = Engine("engine-0", url, v, time.time())
            svc.reg.engines[engine.engine_id] = engine
            try:
                await svc.update(engine, Published(v + 1, SharedDir(str(weights)), time.time()))
            finally:
                await c.request("POST", "/slow_down", {"forward_sleep_time": None})
                await c.request("POST", "/continue_generation", {})
            done: GenerateResult | BaseException
            try:
                [done] = await asyncio.wait_for(flight, 30)
            except Exception as e:  # noqa: BLE001 -- the test inspects what happened
                done = e
        return svc, engine, done
    finally:
        await runner.cleanup()


def failures(svc: SyncService) -> float:
    return (
        svc.ctx.registry.get_sample_value(
            "flywheel_sync_update_failures_total", {"engine": "engine-0"}
        )
        or 0.0
    )


def test_sync_sends_the_engines_api_key(engines: Any, new_weights: Path, run_async: Any) -> None:
    async def body() -> None:
        state = engines("0.5.23")
        v = int(state.scheduler.served_version)
        svc, engine, _ = await update_with_request_in_flight(state, "retract", new_weights)
        assert engine.version == v + 1 and failures(svc) == 0
        svc, engine, _ = await update_with_request_in_flight(state, "retract", new_weights,
                                                             key=None)  # fmt: skip
        assert engine.version == v + 1 and failures(svc) == 1  # 401 without the key

    run_async(body(), timeout_s=120)


@pytest.mark.parametrize("release", ["0.5.9", "0.5.23"])
def test_in_place_keeps_the_request_and_its_cache_and_never_flushes(
    release: str, engines: Any, new_weights: Path, run_async: Any
) -> None:
    state = engines(release)

    async def body() -> None:
        v = int(state.scheduler.served_version)
        svc, engine, done = await update_with_request_in_flight(state, "in_place", new_weights)
        assert engine.version == v + 1 and failures(svc) == 0
        assert state.scheduler.alive(), state.scheduler.crashed  # 0.5.9 died on a flush
        assert isinstance(done, GenerateResult) and done.finish_type == "length"
        if state.caps.reports_version_spans:
            assert [s.version for s in done.weight_versions] == [v, v + 1]

    run_async(body(), timeout_s=120)


@pytest.mark.parametrize("release", ["0.5.21", "0.5.23"])
def test_retract_requeues_the_request_and_flushes_where_it_can(
    release: str, engines: Any, new_weights: Path, run_async: Any
) -> None:
    state = engines(release)

    async def body() -> None:
        v = int(state.scheduler.served_version)
        svc, engine, done = await update_with_request_in_flight(state, "retract", new_weights)
        assert engine.version == v + 1 and failures(svc) == 0 and state.scheduler.alive()
        assert isinstance(done, GenerateResult) and done.finish_type == "length"

    run_async(body(), timeout_s=120)


def test_abort_ends_the_request_and_updates(
    engines: Any, new_weights: Path, run_async: Any
) -> None:
    async def body() -> None:
        state = engines("0.5.23")
        v = int(state.scheduler.served_version)
        svc, engine, done = await update_with_request_in_flight(state, "abort", new_weights)
        assert engine.version == v + 1 and failures(svc) == 0
        assert isinstance(done, GenerateResult) and done.finish_type == "abort"

    run_async(body(), timeout_s=120)


def test_retract_on_0_5_4_is_refused_naming_the_release_before_pausing(
    engines: Any, new_weights: Path, run_async: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        state = engines("0.5.4")
        v = int(state.scheduler.served_version)
        svc, engine, done = await update_with_request_in_flight(state, "retract", new_weights)
        assert engine.version == v and failures(svc) == 1
        # Nothing was paused: 0.5.4's pause would have aborted the request.
        assert isinstance(done, GenerateResult) and done.finish_type == "length"
        # No update of it can ever succeed: sync stops, naming the release and the fix.
        assert svc.fatal is not None and "update_mode = 'retract'" in str(svc.fatal)
        with pytest.raises(ConfigError, match=r"SGLang 0\.5\.4 cannot pause in 'retract'"):
            await svc.reconcile_loop(asyncio.Event())

    run_async(body(), timeout_s=120)
    assert "SGLang 0.5.4 cannot pause in 'retract' mode" in caplog.text


def test_wait_and_abort_work_on_0_5_4(engines: Any, new_weights: Path, run_async: Any) -> None:
    async def body() -> None:
        state = engines("0.5.4")
        for mode in ("wait", "abort"):
            v = int(state.scheduler.served_version)
            svc, engine, done = await update_with_request_in_flight(state, mode, new_weights)
            assert engine.version == v + 1 and failures(svc) == 0, mode
            assert isinstance(done, GenerateResult)
            assert done.finish_type == ("length" if mode == "wait" else "abort")

    run_async(body(), timeout_s=180)


@pytest.mark.parametrize("release", ["0.5.9", "0.5.23"])
def test_what_flywheel_sent_before_flush_cache_true_in_place(
    release: str, model_dir: Path, new_weights: Path, run_async: Any
) -> None:
    """The old sync's in_place update (flush_cache left True), as each release answers it:
    0.5.23 refuses it (400), 0.5.9's scheduler dies (and the engine with it)."""
    state = create_state(load_settings(EngineSettings, model=model_dir, weight_version="0",
                                       sglang_version=release))  # fmt: skip
    crashed: list[str] = []
    state.on_crash = crashed.append

    async def body() -> None:
        runner = web.AppRunner(build_app(state), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with EngineClient(url, retries=0) as c:
                await c.request("POST", "/slow_down", {"forward_sleep_time": 0.05})
                flight = asyncio.create_task(
                    c.generate([4, 5], sampling_params={"max_new_tokens": 60, "ignore_eos": True})
                )
                while (await c.loads()).running < 1:
                    await asyncio.sleep(0.02)
                await c.pause_generation("in_place")
                with pytest.raises(EngineHTTPError) as e:
                    await c.update_weights_from_disk(str(new_weights), 1, update_mode="in_place",
                                                     flush_cache=True)  # fmt: skip
                if not state.scheduler.crashed:
                    await c.request("POST", "/slow_down", {"forward_sleep_time": None})
                    await c.continue_generation()
                    await flight
                else:  # SGLang's process dies: the open generation gets no answer
                    with pytest.raises(EngineError):
                        await flight
        finally:
            await runner.cleanup()
        if release == "0.5.23":
            assert e.value.status == 400 and "cache was not flushed" in e.value.message
            assert state.scheduler.alive()
        else:
            state.scheduler._thread.join(5)
            assert e.value.status == 503 and not state.scheduler.alive()
            assert crashed and "Cache flush failed after updating weights" in crashed[0]

    try:
        run_async(body(), timeout_s=60)
    finally:
        state.scheduler.stop()


def test_a_new_sync_continues_an_engine_left_paused(
    engines: Any, nats_server: Any, run_async: Any
) -> None:
    """A sync killed between pause and continue leaves its engine paused at the new
    version: no update is due, so only a sync that resumes every engine it meets helps."""
    import nats

    from proto.streams import streams_for
    from services.runtime.nats_conn import ensure_streams

    state = engines("0.5.23")

    async def body() -> None:
        runner = web.AppRunner(build_app(state), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        nc = await nats.connect(nats_server.url)
        try:
            async with EngineClient(url, api_key=KEY) as c:
                await c.pause_generation("retract")
                assert state.scheduler.paused
                ctx = Ctx()
                ctx.js = nc.jetstream()  # type: ignore[attr-defined]
                ctx.max_payload = 1 << 20  # type: ignore[attr-defined]
                await ensure_streams(ctx.js, streams_for("resume"))  # type: ignore[attr-defined]
                svc = SyncService(ctx, SyncSettings(run="resume", engine_api_key=KEY))  # type: ignore[arg-type]
                v = int(state.scheduler.served_version)
                svc.reg.heartbeat("engine-0", url, v, time.time())
                await svc.reconcile()
                if svc.tasks:
                    await asyncio.wait(svc.tasks, timeout=10)
                assert not state.scheduler.paused
                [res] = await c.generate([4, 5], sampling_params={"max_new_tokens": 2})
                assert res.finish_type == "length"
        finally:
            await nc.close()
            await runner.cleanup()

    run_async(body(), timeout_s=60)

"""EngineClient failure policy against real (hand-written) HTTP servers, and the API key."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from services.engine.app import build_app, create_state
from services.engine.settings import EngineSettings
from services.engine_api.engine_client import (
    EngineClient,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
)
from services.runtime.settings import load_settings
from tests.harness.engines import serving
from tests.harness.ports import free_port


def fake_engine(hits: list[str], release: asyncio.Event | None = None) -> web.Application:
    """Answers like an engine would, and records every request path.

    input_ids [2] hangs until `release` is set (the test sets it before the
    server shuts down, which waits for in-flight handlers).
    """

    async def generate(request: web.Request) -> web.Response:
        hits.append(request.path)
        body = await request.json()
        if body.get("input_ids") == [0]:
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        if body.get("input_ids") == [1]:
            return web.Response(text="internal trouble", status=500)
        if body.get("input_ids") == [2]:
            await (release or asyncio.Event()).wait()
        meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 1,
                "completion_tokens": 2, "weight_version": "5", "e2e_latency": 0.1,
                "output_token_logprobs": [[-0.1, 4, None], [-0.2, 5, None]]}  # fmt: skip
        return web.json_response({"text": "xy", "output_ids": [4, 5], "meta_info": meta})

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


def test_generate_result_and_http_errors_are_not_retried(run_async: Any) -> None:
    async def body() -> None:
        hits: list[str] = []
        release = asyncio.Event()
        async with serving(fake_engine(hits, release)) as url, EngineClient(url, retries=3) as c:
            [res] = await c.generate([3], sampling_params={"max_new_tokens": 2})
            assert (res.output_ids, res.logprobs) == ([4, 5], [-0.1, -0.2])
            assert (res.finish_type, res.weight_version, res.aborted) == ("length", 5, False)
            with pytest.raises(EngineHTTPError) as e400:
                await c.generate([0])
            assert (e400.value.status, e400.value.message) == (400, "bad prompt")
            with pytest.raises(EngineHTTPError) as e500:
                await c.generate([1])
            assert (e500.value.status, e500.value.message) == (500, "internal trouble")
            with pytest.raises(EngineTimeout):
                await c.generate([2], timeout_s=0.3)
            release.set()
        assert len(hits) == 4  # one request each: errors and timeouts are not re-sent

    run_async(body())


def test_connection_errors_are_retried_then_unavailable(run_async: Any) -> None:
    async def body() -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        async with EngineClient(url, retries=2, backoff_s=0.01) as c:
            with pytest.raises(EngineUnavailable, match="after 3 attempts"):
                await c.model_info()
            assert await c.health() is False
        # An engine that comes up while the client is retrying is reached.
        hits: list[str] = []
        async with EngineClient(url, retries=200, backoff_s=0.01, max_backoff_s=0.02) as c:
            call = asyncio.create_task(c.generate([3]))
            await asyncio.sleep(0.1)  # let a few attempts fail before the server exists
            assert not call.done()
            async with serving(fake_engine(hits), port):
                [res] = await call
        assert res.output_ids == [4, 5] and hits == ["/generate"]

    run_async(body())


def test_api_key_guards_every_path_but_health_and_ready(
    run_async: Any, tiny_model_dir: Path
) -> None:
    """SGLang's utils/auth.py: with --api-key only /health*, /ready*, /metrics* are open."""

    async def body() -> None:
        settings = load_settings(EngineSettings, model=tiny_model_dir, api_key="s3cret",
                                 health_generation=False)  # fmt: skip
        state = await asyncio.to_thread(create_state, settings)
        try:
            async with serving(build_app(state)) as url:
                async with EngineClient(url, retries=0) as anon:
                    assert await anon.health()
                    assert (await anon.request("GET", "/ready")) is None
                    for path in ("/server_info", "/model_info", "/v1/loads", "/ping"):
                        with pytest.raises(EngineHTTPError) as e:
                            await anon.request("GET", path)
                        assert (e.value.status, e.value.message) == (401, "Unauthorized"), path
                    with pytest.raises(EngineHTTPError) as e:
                        await anon.generate([5, 6], sampling_params={"max_new_tokens": 2})
                    assert e.value.status == 401
                    with pytest.raises(EngineHTTPError) as e:
                        await anon.detect()
                    assert e.value.status == 401
                async with EngineClient(url, api_key="s3cret") as admin:
                    [res] = await admin.generate([5, 6], sampling_params={"max_new_tokens": 2})
                    assert res.completion_tokens >= 1
                    await admin.pause_generation("in_place")
                    await admin.continue_generation()
                    upd = await admin.update_weights_from_disk(str(tiny_model_dir), 1)
                    assert upd.success and await admin.weight_version() == 1
                    assert (await admin.loads()).running == 0
        finally:
            state.scheduler.stop()

    run_async(body())

"""The teacher pool (services/engine_api/teacher.py) against real servers: a real CPU
engine scores; a port nobody listens on fails a try and the next engine answers; with
no try left the sample fails with `TeacherFailed`; no more than `concurrency` scoring
requests are in flight at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from services.engine_api.engine_client import EngineClient
from services.engine_api.teacher import TeacherFailed, TeacherPool, TeacherSettings
from services.models.tiny_model import build_tokenizer
from tests.harness.engines import EngineProcess, serving
from tests.harness.ports import free_port

TOK = build_tokenizer()


def settings(**kw: Any) -> TeacherSettings:
    return TeacherSettings(**{"urls": ["unused"], "retry_backoff_s": 0.0, **kw})


def test_a_dead_engine_costs_a_try_and_the_next_one_answers(
    run_async: Any, engine: EngineProcess
) -> None:
    prompt, response = TOK.encode("3+4="), TOK.encode("7")
    dead = f"http://127.0.0.1:{free_port()}"

    async def body() -> tuple[Any, list[float]]:
        async with TeacherPool(settings(attempts=2, name="t"), [dead, engine.url]) as pool:
            got = await pool.score(prompt, response)
        async with EngineClient(engine.url) as c:
            direct = await c.prompt_logprobs(prompt + response, len(prompt) - 1)
        return got, direct

    got, direct = run_async(body())
    assert got.logprobs == direct and len(got.logprobs) == len(response)
    assert got.model == str(engine.model_dir) and got.version == 0


def test_no_try_left_is_teacher_failed_with_the_last_error(run_async: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def body() -> None:
        async with TeacherPool(settings(attempts=3, name="gone"), [dead]) as pool:
            await pool.score([1, 2], [3])

    with pytest.raises(TeacherFailed, match=r"teacher 'gone': 3 tries failed; last: http"):
        run_async(body())


def test_at_most_concurrency_requests_are_in_flight(run_async: Any) -> None:
    """A slow server that answers as SGLang does and counts requests in flight."""
    live = {"now": 0, "most": 0}

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23", "model_path": "/m", "weight_version": "0"})

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])
        await asyncio.sleep(0.1)
        live["now"] -= 1
        ids = body["input_ids"][body["logprob_start_len"] :]
        lps = [[None if i == 0 else -1.0, t, None] for i, t in enumerate(ids)]
        return web.json_response({"meta_info": {"input_token_logprobs": lps}})

    app = web.Application()
    app.router.add_get("/server_info", info)
    app.router.add_get("/model_info", info)
    app.router.add_post("/generate", generate)

    async def body() -> list[Any]:
        async with serving(app) as url, TeacherPool(settings(concurrency=3), [url]) as pool:
            return await asyncio.gather(*(pool.score([1, 2], [3, 4]) for _ in range(10)))

    scores = run_async(body())
    assert all(s.logprobs == [-1.0, -1.0] and s.model == "/m" for s in scores)
    assert live["most"] == 3

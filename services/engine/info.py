"""The engine's read-only endpoints: model and server info, loads, flush_cache.

Bodies as SGLang answers them (`entrypoints/http_server.py`, `v1_loads.py`,
`managers/load_snapshot.py`); which of the routes exist depends on the
release the engine emulates (`build_app` in server.py registers them).
`/server_info` reports that release as `version`, which is how a client
tells what it talks to.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from services.engine.state import STATE
from services.engine_api.sglang_api import FLUSH_FAILED

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "model_path": state.model_path,
            "tokenizer_path": str(state.settings.model),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.scheduler.weight_version,
        }
    )


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[STATE].scheduler.weight_version})


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    settings = state.settings.model_dump(mode="json", exclude={"api_key", "nats"})
    return web.json_response(
        {
            **settings,
            "model_path": state.model_path,
            "context_length": state.context_len,
            "weight_version": state.scheduler.weight_version,
            "internal_states": [{**_snapshot(state), "last_gen_throughput": 0.0}],
            "version": state.settings.sglang_version,
            "flywheel_engine": "cpu",
        }
    )


def _snapshot(state: Any) -> dict[str, Any]:
    snap = dict(state.scheduler.load())
    snap.pop("paused", None)
    return snap  # num_held_reqs: waiting outside the scheduler (SGLang's tokenizer manager)


class Throughput:
    """Generated tokens per second between two load reads."""

    def __init__(self) -> None:
        self.last = (time.monotonic(), 0)

    def rate(self, tokens: int) -> float:
        now = time.monotonic()
        t0, n0 = self.last
        self.last = (now, tokens)
        return (tokens - n0) / (now - t0) if now > t0 else 0.0


THROUGHPUT: web.AppKey[Throughput] = web.AppKey("throughput", Throughput)


async def loads(request: web.Request) -> web.Response:
    """`/v1/loads` (0.5.8+): one LoadSnapshot's core fields for the one rank here."""
    state = request.app[STATE]
    snap = state.scheduler.load()
    max_running = state.settings.max_running_requests
    max_tokens = max_running * state.context_len
    waiting_tokens = 0
    entry = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": snap["num_running_reqs"],
        "num_waiting_reqs": snap["num_waiting_reqs"],
        "num_waiting_uncached_tokens": waiting_tokens,
        "num_used_tokens": snap["num_used_tokens"],
        "num_total_tokens": snap["num_used_tokens"] + waiting_tokens,
        "num_active_tokens": snap["num_used_tokens"] + waiting_tokens,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": max_tokens,
        "max_running_requests": max_running,
        "token_usage": snap["num_used_tokens"] / max_tokens,
        "gen_throughput": request.app[THROUGHPUT].rate(state.scheduler.generated_tokens),
        "cache_hit_rate": 0.0,
        "utilization": snap["num_running_reqs"] / max_running,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
    }
    return web.json_response(
        {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": state.settings.sglang_version,
            "accelerator": "CPU",  # get_device_name(); a GPU name on SGLang
            "num_accelerators": 1,
            "loads": [entry],
        }
    )


async def get_load(request: web.Request) -> web.Response:
    """`/get_load` (up to 0.5.20): a list of GetLoadReqOutput, `num_reqs` = running + waiting."""
    snap = request.app[STATE].scheduler.load()
    waiting = snap["num_waiting_reqs"]
    row = {
        "rid": None,
        "http_worker_ipc": None,
        "dp_rank": 0,
        "num_reqs": snap["num_running_reqs"] + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": snap["num_used_tokens"],
    }
    return web.json_response([row])


async def flush_cache(request: web.Request) -> web.Response:
    """Drop the prefix cache; SGLang's rule: refused (400) unless nothing is in flight,
    from 0.5.10 after waiting up to `?timeout=` seconds for that (Scheduler.flush_cache)."""
    import asyncio

    state = request.app[STATE]
    timeout = 0.0
    if state.caps.flush_cache_waits:
        parsed = _query_seconds(request.query.get("timeout"), "timeout")
        if isinstance(parsed, web.Response):
            return parsed
        timeout = parsed
    ok, message = await asyncio.wrap_future(state.scheduler.flush_cache(timeout))
    if ok:
        return web.Response(text=FLUSHED, status=200)
    text = (message or FLUSH_FAILED) if state.caps.flush_cache_waits else FLUSHED
    return web.Response(text=text, status=400)


def _query_seconds(raw: str | None, name: str) -> float | web.Response:
    """FastAPI's `Query(0.0, ge=0.0)`: the value, or its 422 with pydantic's error."""
    from typing import Annotated

    from pydantic import Field, TypeAdapter, ValidationError

    if raw is None:
        return 0.0
    try:
        return float(TypeAdapter(Annotated[float, Field(ge=0.0)]).validate_python(raw))
    except ValidationError as e:
        detail = [{**err, "loc": ["query", name]} for err in e.errors(include_url=False)]
        return web.json_response({"detail": detail}, status=422)

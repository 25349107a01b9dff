"""The HTTP adapter: SGLang's native endpoints on aiohttp, in front of the Scheduler.

Handlers only parse, hand work to the scheduler thread and await its
answer (`asyncio.wrap_future`), so the event loop stays responsive while
the model computes. Paths and bodies follow SGLang 0.5.x's
`entrypoints/http_server.py`; both the current names (`/model_info`,
`/server_info`) and the older `get_` aliases are served. A client that goes
away mid-generation aborts its sequences (SGLang does the same).

`/v1/loads` answers `{"timestamp", "dp_rank_count", "loads": [one
GetLoadsReqOutput-shaped dict]}` (one data-parallel rank here).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.rollout.engine.protocol import (
    Completion,
    ParsedGenerate,
    RequestError,
    SamplingParams,
    SeqSpec,
    parse_generate,
    response,
    trim_text,
)
from services.rollout.engine.scheduler import PAUSE_MODES, Scheduler, SchedulerStopped
from services.rollout.engine.settings import EngineSettings

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's error body: {"error": {"message": ...}} (plus type/code like OpenAI's)."""
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return web.json_response(body, status=status)


async def _json_body(request: web.Request) -> Any:
    if not request.can_read_body:
        return {}
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e


@dataclass
class EngineState:
    """What the handlers share: settings, tokenizer, scheduler, start time."""

    settings: EngineSettings
    tokenizer: Any
    scheduler: Scheduler
    vocab_size: int
    context_len: int
    model_path: str
    started: float

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


STATE: web.AppKey[EngineState] = web.AppKey("engine_state", EngineState)

ADMIN_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/slow_down",
    }
)


def api_key_middleware(key: str) -> Any:
    """Require `Authorization: Bearer <key>` on the admin endpoints (constant-time compare)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in ADMIN_PATHS:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return error("Unauthorized", 401)
        return await handler(request)

    return middleware


async def run_seqs(state: EngineState, seqs: list[SeqSpec]) -> list[Completion]:
    """Submit sequences and await all; abort them if the caller is cancelled."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Completion]] = []
    for spec in seqs:
        fut: asyncio.Future[Completion] = loop.create_future()

        def done(c: Completion, fut: asyncio.Future[Completion] = fut) -> None:
            loop.call_soon_threadsafe(_resolve, fut, c)

        state.scheduler.submit(spec, done)
        futures.append(fut)
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:
        for rid in {s.rid for s in seqs}:
            state.scheduler.abort(rid)
        raise


def _resolve(fut: asyncio.Future[Completion], c: Completion) -> None:
    if not fut.done():
        fut.set_result(c)


async def generate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _json_body(request)
        parsed: ParsedGenerate = parse_generate(
            body,
            state.encode,
            state.vocab_size,
            state.context_len,
            state.settings.default_max_new_tokens,
        )
    except RequestError as e:
        return error(str(e))
    try:
        done = await run_seqs(state, parsed.seqs)
    except SchedulerStopped as e:
        return error(str(e), 503)
    out = []
    for spec, c in zip(parsed.seqs, done, strict=True):
        text = state.decode(c.output_ids, spec.params.skip_special_tokens)
        out.append(response(spec, c, trim_text(text, spec.params, c.matched_stop_str)))
    return web.json_response(out if parsed.as_list else out[0])


async def update_weights_from_disk(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _json_body(request)
    except RequestError as e:
        return error(str(e))
    path = body.get("model_path") if isinstance(body, dict) else None
    if not isinstance(path, str) or not path:
        return error("model_path (a string) is required")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        return error("weight_version must be a string")
    abort_all = bool(body.get("abort_all_requests", False))
    ok, message, paused = await asyncio.wrap_future(
        state.scheduler.update_weights(path, version, abort_all)
    )
    if ok:
        state.model_path = path
        if version is not None:
            message += f" Weight version updated to {version}."
    content = {"success": ok, "message": message, "num_paused_requests": paused}
    return web.json_response(content, status=200 if ok else 400)


async def pause_generation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _json_body(request)
    except RequestError as e:
        return error(str(e))
    mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
    if mode not in PAUSE_MODES:
        return error(f"mode must be one of {', '.join(PAUSE_MODES)}")
    await asyncio.wrap_future(state.scheduler.pause(mode))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await asyncio.wrap_future(request.app[STATE].scheduler.resume())
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _json_body(request)
    except RequestError as e:
        return error(str(e))
    if not isinstance(body, dict):
        return error("request body must be a JSON object")
    rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
    if not abort_all and not isinstance(rid, str):
        return error("rid (a string) or abort_all=true is required")
    await asyncio.wrap_future(state.scheduler.abort(rid, abort_all))
    return web.Response(status=200)


async def slow_down(request: web.Request) -> web.Response:
    """SGLang's testing hook: {"forward_sleep_time": seconds | null} after every decode step."""
    state = request.app[STATE]
    try:
        body = await _json_body(request)
    except RequestError as e:
        return error(str(e))
    seconds = body.get("forward_sleep_time") if isinstance(body, dict) else None
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float)
                                or not 0 <= seconds <= 10):  # fmt: skip
        return error("forward_sleep_time must be a number of seconds in [0, 10] or null")
    await asyncio.wrap_future(state.scheduler.slow_down(seconds))
    return web.Response(status=200)


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
            "internal_states": [state.scheduler.load()],
            "version": "flywheel-cpu-engine",
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE].scheduler.alive() else 503)


async def health_generate(request: web.Request) -> web.Response:
    """Generate one token end to end; 503 if it fails or takes too long.

    While generation is paused the probe answers 200 without generating: a
    deliberate pause (weight sync) is not a fault.
    """
    state = request.app[STATE]
    if not state.scheduler.alive():
        return web.Response(status=503)
    if state.scheduler.load()["paused"]:
        return web.Response(status=200)
    spec = SeqSpec(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        out_id="health",
        input_ids=(0,),
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
        return_logprob=False,
    )
    try:
        await asyncio.wait_for(
            run_seqs(state, [spec]), timeout=state.settings.health_generate_timeout_s
        )
    except (TimeoutError, SchedulerStopped):
        return web.Response(status=503)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    """No prefix cache to flush on CPU; like SGLang, refuse (400) while requests run."""
    idle = await asyncio.wrap_future(request.app[STATE].scheduler.idle())
    if idle:
        return web.Response(text="Cache flushed.\n", status=200)
    return web.Response(
        text="Cache not flushed: there are running or waiting requests.\n", status=400
    )


class _Throughput:
    """Generated tokens per second between two /v1/loads calls."""

    def __init__(self) -> None:
        self.last = (time.monotonic(), 0)

    def rate(self, tokens: int) -> float:
        now = time.monotonic()
        t0, n0 = self.last
        self.last = (now, tokens)
        return (tokens - n0) / (now - t0) if now > t0 else 0.0


THROUGHPUT: web.AppKey[_Throughput] = web.AppKey("throughput", _Throughput)


async def loads(request: web.Request) -> web.Response:
    state = request.app[STATE]
    snap = state.scheduler.load()
    max_running = state.settings.max_running_requests
    max_tokens = max_running * state.context_len
    entry = {
        "dp_rank": 0,
        "timestamp": time.time(),
        "num_running_reqs": snap["num_running_reqs"],
        "num_waiting_reqs": snap["num_waiting_reqs"],
        "num_used_tokens": snap["num_used_tokens"],
        "max_total_num_tokens": max_tokens,
        "token_usage": snap["num_used_tokens"] / max_tokens,
        "gen_throughput": request.app[THROUGHPUT].rate(state.scheduler.generated_tokens),
        "cache_hit_rate": 0.0,
        "utilization": snap["num_running_reqs"] / max_running,
        "max_running_requests": max_running,
    }
    return web.json_response(
        {"timestamp": entry["timestamp"], "dp_rank_count": 1, "loads": [entry]}
    )


def build_app(state: EngineState) -> web.Application:
    key = state.settings.api_key
    middlewares = [api_key_middleware(key.get_secret_value())] if key else []
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    app[THROUGHPUT] = _Throughput()
    r = app.router
    for method in ("POST", "PUT"):
        r.add_route(method, "/generate", generate)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_post("/slow_down", slow_down)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/get_weight_version", weight_version)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/flush_cache", flush_cache)
    r.add_get("/v1/loads", loads)
    return app


def create_state(settings: EngineSettings) -> EngineState:
    """Load the model and tokenizer and start the scheduler thread (heavy imports here)."""
    from transformers import AutoTokenizer

    from services.rollout.engine.runner import ModelRunner, eos_ids

    if settings.model is None:
        raise RequestError("no model directory given (--model or [engine] model)")
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    runner = ModelRunner(
        settings.model, num_threads=settings.num_threads, weights_check=settings.weights_check
    )

    def decode(ids: list[int], skip: bool) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip))

    scheduler = Scheduler(
        runner,
        eos=eos_ids(settings.model, tokenizer),
        decode=decode,
        weight_version=settings.weight_version,
        max_running_requests=settings.max_running_requests,
        random_seed=settings.random_seed,
    )
    scheduler.start()
    return EngineState(
        settings=settings,
        tokenizer=tokenizer,
        scheduler=scheduler,
        vocab_size=runner.vocab_size,
        context_len=runner.context_len,
        model_path=str(settings.model),
        started=time.time(),
    )


async def serve(settings: EngineSettings, stop: asyncio.Event) -> None:
    """Serve until `stop` is set; logs the bound address once listening."""
    state = await asyncio.to_thread(create_state, settings)
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else settings.port
    log.info("engine serving %s on http://%s:%d", settings.model, settings.host, port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        state.scheduler.stop()

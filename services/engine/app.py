"""The HTTP adapter: SGLang's native endpoints on aiohttp, in front of the Scheduler.

Handlers only parse, hand work to the scheduler thread and await its
answer (`asyncio.wrap_future`), so the event loop stays responsive while
the model computes. The engine answers as one SGLang release
(`[engine] sglang_version`, default the newest read): that release's routes
(`/model_info` or only `/get_model_info`, `/v1/loads` or `/get_load`, ...),
pause modes, duplicate-rid and flush rules, error bodies and meta_info
fields (services/engine_api/sglang_api.py has the table; tests/contract holds
the request/response pairs both this engine and the client are run
against). A client that goes away mid-generation aborts its sequences
(SGLang does the same).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from services.engine import dist_api, info, lora_api, loras, memory_api, openai_api, probes
from services.engine.core.protocol import RequestError
from services.engine.generate import generate
from services.engine.http import error, json_route
from services.engine.scheduler import PAUSE_MODES, Scheduler, SchedulerStopped
from services.engine.settings import EngineSettings
from services.engine.state import STATE, EngineState

log = logging.getLogger(__name__)

__all__ = ["STATE", "EngineState", "build_app", "create_state", "serve"]


@json_route
async def update_weights_from_disk(
    request: web.Request, state: EngineState, body: Any
) -> web.Response:
    path = body.get("model_path") if isinstance(body, dict) else None
    if not isinstance(path, str) or not path:
        raise RequestError("model_path (a string) is required")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise RequestError("weight_version must be a string")
    abort_all = bool(body.get("abort_all_requests", False))
    # Before 0.5.6 there is no flush_cache field: the scheduler always flushes.
    flush = bool(body.get("flush_cache", True)) if state.caps.has_flush_cache_field else True
    try:
        ok, message, paused = await asyncio.wrap_future(
            state.scheduler.update_weights(
                state.scheduler.runner.disk_loader(path), version, abort_all, flush
            )
        )
    except SchedulerStopped as e:
        if state.scheduler.crashed:
            state.crash(state.scheduler.crashed)
        return error(str(e), 503)
    if ok:
        state.model_path = path
        if version is not None:
            message += f" Weight version updated to {version}."
    content = {"success": ok, "message": message, "num_paused_requests": paused}
    return web.json_response(content, status=200 if ok else 400)


@json_route
async def pause_generation(request: web.Request, state: EngineState, body: Any) -> web.Response:
    mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
    if len(state.caps.pause_modes) == 1:
        mode = "abort"  # before 0.5.6 the endpoint reads no body: it always aborts
    elif mode not in PAUSE_MODES:
        raise RequestError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
    await asyncio.wrap_future(state.scheduler.pause(mode))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await asyncio.wrap_future(request.app[STATE].scheduler.resume())
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


@json_route
async def abort_request(request: web.Request, state: EngineState, body: Any) -> web.Response:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
    if not abort_all and not isinstance(rid, str):
        raise RequestError("rid (a string) or abort_all=true is required")
    await asyncio.wrap_future(state.scheduler.abort(rid, abort_all))
    return web.Response(status=200)


@json_route
async def slow_down(request: web.Request, state: EngineState, body: Any) -> web.Response:
    """SGLang's testing hook: {"forward_sleep_time": seconds | null} after every decode step."""
    seconds = body.get("forward_sleep_time") if isinstance(body, dict) else None
    if seconds is not None and not _seconds_ok(seconds):
        raise RequestError("forward_sleep_time must be a number of seconds in [0, 10] or null")
    await asyncio.wrap_future(state.scheduler.slow_down(seconds))
    return web.Response(status=200)


def _seconds_ok(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 <= value <= 10


async def health(request: web.Request) -> web.Response:
    """`/health` and `/health_generate` (probes.Health.check has SGLang's rules)."""
    state = request.app[STATE]
    sched = state.scheduler
    status = await state.health.check(
        request.path, sched.submit, sched.abort, lambda: sched.last_output, sched.alive()
    )
    return web.Response(status=status)


async def ping(request: web.Request) -> web.Response:
    state = request.app[STATE]
    ok = not state.caps.ping_reports_health or (state.health.healthy and state.scheduler.alive())
    return web.Response(status=200 if ok else 503)


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    sched = state.scheduler
    ok = sched.alive() and state.health.healthy and not sched.paused
    return web.Response(status=200 if ok else 503)


def build_app(state: EngineState) -> web.Application:
    """The routes of the emulated release (see the module table in sglang_api.py)."""
    caps = state.caps
    key = state.settings.api_key
    middlewares = [probes.api_key_middleware(key.get_secret_value(), caps)] if key else []
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    app[info.THROUGHPUT] = info.Throughput()
    r = app.router
    for method in ("POST", "PUT"):
        r.add_route(method, "/generate", generate)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_route("*", "/slow_down", slow_down)
    r.add_route("*", "/flush_cache", info.flush_cache)
    r.add_get("/get_model_info", info.model_info)
    r.add_get("/get_server_info", info.server_info)
    r.add_get("/get_weight_version", info.weight_version)
    if caps.at_least(0, 5, 6):
        r.add_get("/model_info", info.model_info)
        r.add_get("/server_info", info.server_info)
        r.add_get("/weight_version", info.weight_version)
    if caps.at_least(0, 5, 8):
        r.add_get("/v1/loads", info.loads)
    if caps.has_get_load:
        r.add_get("/get_load", info.get_load)
    r.add_get("/health", health)
    r.add_get("/health_generate", health)
    r.add_get("/ping", ping)
    if caps.has_ready:
        r.add_get("/ready", ready)
    openai_api.add_routes(r)
    lora_api.add_routes(r)
    memory_api.add_routes(r)
    dist_api.add_routes(app, state)
    return app


def create_state(settings: EngineSettings) -> EngineState:
    """Load the model and tokenizer and start the scheduler thread (heavy imports here)."""
    from transformers import AutoTokenizer

    from services.engine.core.openai_protocol import generation_defaults
    from services.engine.runner import ModelRunner, eos_ids, generation_config

    if settings.model is None:
        raise RequestError("no model directory given (--model or [engine] model)")
    caps = settings.capabilities
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
        caps=caps,
        prefix_cache_bytes=int(settings.prefix_cache_mib * 2**20),
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
        caps=caps,
        chat_defaults=(
            generation_defaults(
                generation_config(settings.model), caps.generation_config_fills_hf_defaults
            )
            if settings.sampling_defaults == "model"
            else {}
        ),
        health=probes.Health(caps, settings.health_generation, settings.health_check_timeout_s),
        lora=loras.Loras(
            loras.limits_of(settings.lora), caps, scheduler, runner.model, runner.vocab_size
        ),
    )


class EngineCrashed(SystemExit):
    """The scheduler died (as SGLang's does on a failed post-update flush): exit 1."""


async def serve(settings: EngineSettings, stop: asyncio.Event) -> None:
    """Serve until `stop` is set (or the scheduler crashes: EngineCrashed)."""
    state = await asyncio.to_thread(create_state, settings)
    crashed: list[str] = []

    def on_crash(why: str) -> None:
        crashed.append(why)
        stop.set()

    state.on_crash = on_crash
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else settings.port
    log.info(
        "engine serving %s on http://%s:%d as SGLang %s",
        settings.model,
        settings.host,
        port,
        settings.sglang_version,
    )
    watchdog = asyncio.create_task(probes.watch_scheduler(state.scheduler, on_crash, stop))
    try:
        await stop.wait()
    finally:
        watchdog.cancel()
        await runner.cleanup()
        state.scheduler.stop()
    if crashed:
        log.critical("engine exits: %s", crashed[0])
        raise EngineCrashed(1)

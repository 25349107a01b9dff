"""Colocation routes of the CPU engine: SGLang's memory release and resume, and
Flywheel's own thread-count hook.

`/release_memory_occupation` and `/resume_memory_occupation` are how a
colocated trainer and SGLang share a GPU: the engine gives up its weights and
KV cache around a training step and takes them back after. They are answered
here as SGLang answers them (`http_server.py`, the scheduler's
`release_memory_occupation` / `resume_memory_occupation`; the release rules
are `Capabilities.release_refused` in services/engine_api/sglang_api.py):

- the body is `{"tags": [...]}` (null or empty: every tag of the release);
  success is 200 with the body `null`;
- a release while requests run (as each release counts them) is an assertion
  in SGLang's scheduler: the scheduler dies and takes the server with it, so
  the caller gets no answer and the engine exits 1 (`EngineState.crash`);
- resuming a tag that was not released is `set.remove`'s KeyError in the
  scheduler: the same death.

The CPU engine answers as SGLang started without `--enable-memory-saver`
(its default): the tags are recorded and nothing is freed, and generation
keeps working. On a CPU the resource two colocated roles share is cores, not
memory: `/flywheel/num_threads` (not an SGLang route: SGLang on a GPU has no
such knob and answers 404) sets the engine's torch intra-op threads. It runs
`torch.set_num_threads` on the scheduler thread between two steps: ATen's
parallel ops read OpenMP's per-thread count, which a thread takes from torch's
global one only at its first use (bench/thread_switch.py), so set from the
HTTP thread it would not reach the ops the model computes with.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from services.engine.core.protocol import RequestError
from services.engine.http import json_route
from services.engine.state import EngineState

log = logging.getLogger(__name__)

MAX_THREADS = 1024  # a bound for a typo, not for a machine


def _tags(state: EngineState, body: Any) -> list[str] | web.Response:
    """The request's tags, the release's default set, or the 422 FastAPI's validation
    answers for a wrong shape before SGLang's handler runs."""
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is None or tags == []:
        return list(state.caps.default_memory_tags)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return web.json_response({"detail": "tags must be a list of strings or null"}, status=422)
    return tags


def _dies(request: web.Request, state: EngineState, why: str) -> web.Response:
    """SGLang's scheduler raised: the process dies, this caller hears nothing."""
    log.critical("engine scheduler crashed: %s", why)
    state.crash(f"the engine scheduler crashed: {why}")
    if request.transport is not None:
        request.transport.close()
    return web.Response(status=500)  # never reaches the caller: the connection is gone


@json_route
async def release_memory_occupation(
    request: web.Request, state: EngineState, body: Any
) -> web.Response:
    tags = _tags(state, body)
    if isinstance(tags, web.Response):
        return tags
    sched = state.scheduler
    load = await asyncio.wrap_future(sched.run(sched.load))  # one consistent snapshot
    refused = state.caps.release_refused(
        load["num_running_reqs"], load["num_waiting_reqs"], load["paused"]
    )
    if refused is not None:
        return _dies(request, state, f"AssertionError: {refused}")
    if "kv_cache" in tags:  # SGLang flushes its radix cache with the KV pool it releases
        await asyncio.wrap_future(sched.run(sched._flush))
    state.released.update(tags)
    return web.json_response(None)


@json_route
async def resume_memory_occupation(
    request: web.Request, state: EngineState, body: Any
) -> web.Response:
    tags = _tags(state, body)
    if isinstance(tags, web.Response):
        return tags
    for tag in tags:
        if tag not in state.released:
            return _dies(request, state, f"KeyError: {tag!r}")
        state.released.discard(tag)
    return web.json_response(None)


@json_route
async def num_threads(request: web.Request, state: EngineState, body: Any) -> web.Response:
    """GET: {"num_threads": n}; POST {"num_threads": k}: the model computes with k threads
    from the next step on (answers {"num_threads": k, "previous": n})."""
    import torch

    if request.method == "GET":
        count = await asyncio.wrap_future(state.scheduler.run(torch.get_num_threads))
        return web.json_response({"num_threads": count})
    k = body.get("num_threads") if isinstance(body, dict) else None
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_THREADS:
        raise RequestError(f"num_threads must be an integer in [1, {MAX_THREADS}]")

    def swap() -> int:
        previous = torch.get_num_threads()
        torch.set_num_threads(k)
        return previous

    previous = await asyncio.wrap_future(state.scheduler.run(swap))
    return web.json_response({"num_threads": k, "previous": previous})


def add_routes(r: web.UrlDispatcher) -> None:
    """Every release in the table serves both memory routes (GET or POST, as SGLang)."""
    for method in ("GET", "POST"):
        r.add_route(method, "/release_memory_occupation", release_memory_occupation)
        r.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
        r.add_route(method, "/flywheel/num_threads", num_threads)

"""SGLang's torch.distributed weights protocol on the CPU engine (gloo).

`/init_weights_update_group` joins a process group of its own at
`master_address:master_port` as rank `rank_offset` (a single-rank engine's
tp_rank is 0); rank 0 is the sender. `/update_weights_from_distributed`
receives one broadcast per name from rank 0, allocated from the request's
names, dtypes and shapes, then loads it under the same rules as
`/update_weights_from_disk` (the scheduler's `update_weights`: it waits for
admitted requests unless paused, stamps the version, flushes).
`/destroy_weights_update_group` leaves a group. From 0.5.21 (read in the
0.5.21-0.5.23 wheels; 0.5.16 has no such rule) an update must run inside
`/begin_weight_update` … `/end_weight_update`. Answers are SGLang's:
{"success", "message"}, 400 on failure, with its messages
(srt/model_executor/model_runner_components/weight_updater.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.engine.core.protocol import RequestError
from services.engine.core.sequence import SchedulerStopped, UpdateRefused
from services.engine.state import STATE, EngineState

log = logging.getLogger(__name__)

NO_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)


@dataclass
class Groups:
    """The engine's weights-update groups (touched on the scheduler thread only)."""

    groups: dict[str, Any] = field(default_factory=dict)
    session: bool = False  # 0.5.21+: between begin_weight_update and end_weight_update


GROUPS: web.AppKey[Groups] = web.AppKey("weight_groups", Groups)


def answer(ok: bool, message: str) -> web.Response:
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


def _field(body: Any, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    value = body.get(name, default) if isinstance(body, dict) else default
    if value is ... or not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise RequestError(f"{name} ({getattr(kind, '__name__', kind)}) is required")
    return value


async def _json(request: web.Request) -> Any:
    try:
        return await request.json() if request.can_read_body else {}
    except ValueError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e


async def init_group(request: web.Request) -> web.Response:
    from services.weights.distgroup import join_group

    state, groups = request.app[STATE], request.app[GROUPS]
    body = await _json(request)
    addr, port = _field(body, "master_address", str), _field(body, "master_port", int)
    rank = _field(body, "rank_offset", int) + 0  # + tp_rank: one rank here
    world, backend = _field(body, "world_size", int), _field(body, "backend", str, "nccl")
    name = _field(body, "group_name", str, "weight_update_group")
    if backend == "nccl":
        backend = "gloo"  # no GPU here: the same protocol over gloo
    log.info("init custom process group: %s:%d rank=%d world=%d %s", addr, port, rank, world, name)

    def join() -> tuple[bool, str]:
        try:
            groups.groups[name] = join_group(addr, port, rank, world, name, backend)
        except Exception as e:  # noqa: BLE001 -- SGLang answers any failure with this message
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    return answer(*await asyncio.wrap_future(state.scheduler.run(join)))


async def destroy_group(request: web.Request) -> web.Response:
    from services.weights.distgroup import destroy_group as destroy

    state, groups = request.app[STATE], request.app[GROUPS]
    name = _field(await _json(request), "group_name", str, "weight_update_group")

    def drop() -> tuple[bool, str]:
        if name not in groups.groups:
            return False, "The group to be destroyed does not exist."
        try:
            destroy(groups.groups.pop(name))
        except Exception as e:  # noqa: BLE001 -- SGLang answers any failure with this message
            return False, f"Failed to destroy custom process group: {e}."
        return True, "Succeeded to destroy custom process group."

    return answer(*await asyncio.wrap_future(state.scheduler.run(drop)))


async def begin_update(request: web.Request) -> web.Response:
    groups = request.app[GROUPS]
    if groups.session:
        return answer(
            False, "a weight-update session is already open; call end_weight_update() first"
        )
    groups.session = True
    return answer(True, "Success")


async def end_update(request: web.Request) -> web.Response:
    groups = request.app[GROUPS]
    if not groups.session:
        return answer(False, "no weight-update session is open; call begin_weight_update() first")
    groups.session = False
    return answer(True, "Success")


def receive_loader(state: EngineState, groups: Groups, body: Any) -> Any:
    """The scheduler-thread load of one `/update_weights_from_distributed`."""
    from services.weights.distgroup import receive_tensors

    names, dtypes = _field(body, "names", list), _field(body, "dtypes", list)
    shapes, name = (
        _field(body, "shapes", list),
        _field(body, "group_name", str, "weight_update_group"),
    )

    def load() -> str:
        if groups.session is False and state.caps.at_least(0, 5, 21):
            raise UpdateRefused(NO_SESSION)
        try:
            if name not in groups.groups:
                raise AssertionError(
                    f"Group {name} not in {list(groups.groups)}. "
                    "Please call `init_weights_update_group` first."
                )
            weights = receive_tensors(groups.groups[name], names, dtypes, shapes)
        except Exception as e:  # SGLang answers any failure with this message
            raise UpdateRefused(f"Failed to receive weights: {e}") from e
        try:
            state.scheduler.runner.load_named(weights)
        except Exception as e:  # SGLang answers any failure with this message
            raise UpdateRefused(
                f"Failed to update parameter online: {e}. The full weights of the "
                "ModelRunner are partially updated. Please discard the whole weights."
            ) from e
        return "Succeeded to update parameter online."

    return load


async def update_from_distributed(request: web.Request) -> web.Response:
    state, groups = request.app[STATE], request.app[GROUPS]
    body = await _json(request)
    version = body.get("weight_version") if isinstance(body, dict) else None
    if version is not None and not isinstance(version, str):
        raise RequestError("weight_version must be a string")
    load = receive_loader(state, groups, body)
    flush, abort_all = (
        bool(body.get("flush_cache", True)),
        bool(body.get("abort_all_requests", False)),
    )
    try:
        ok, message, _ = await asyncio.wrap_future(
            state.scheduler.update_weights(load, version, abort_all, flush)
        )
    except SchedulerStopped as e:
        return web.json_response({"error": {"message": str(e)}}, status=503)
    if ok and version is not None:
        message += f" Weight version updated to {version}."
    return answer(ok, message)


def add_routes(app: web.Application, state: EngineState) -> None:
    app[GROUPS] = Groups()
    r = app.router
    for path, handler in (
        ("/init_weights_update_group", init_group),
        ("/destroy_weights_update_group", destroy_group),
        ("/update_weights_from_distributed", update_from_distributed),
    ):
        r.add_post(path, _refusing(handler))
    if state.caps.at_least(0, 5, 21):
        r.add_post("/begin_weight_update", begin_update)
        r.add_post("/end_weight_update", end_update)


def _refusing(handler: Any) -> Any:
    """A RequestError (a malformed body) as the engine's 400."""

    async def route(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except RequestError as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)

    return route

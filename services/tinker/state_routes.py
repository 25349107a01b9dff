"""The SDK's state routes: save_state (`/api/v1/save_weights`), load_state,
load_state_with_optimizer and create_training_client_from_state[_with_optimizer]
(all `/api/v1/load_weights`), and the RestClient's checkpoint listing.

They follow app.py's pattern: the request is checked on the event loop (a bad
name, path, base model or LoRA shape fails its own future with a `user` error
and touches nothing), then the work runs on the model thread in arrival order, so
a save_state after an optim_step saves the stepped weights. A retried POST (same
model and seq_id, or same session and model_seq_id for a create-via-load) gets
the first one's future. The files themselves are state.py's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from services.tinker.core import (
    Entry,
    Limits,
    Registry,
    RequestLog,
    TinkerUserError,
    TrainingModel,
    check_rank,
)
from services.tinker.model import AdapterModel
from services.tinker.routing import future_response as _future
from services.tinker.routing import read_body as _body
from services.tinker.routing import run_if_fresh as _submitted
from services.tinker.state import StateMeta, StateStore, check_name, parse_path


class Service(Protocol):
    """What these routes use of app.py's Service (typed here: app.py imports this module)."""

    base_name: str
    model: AdapterModel
    registry: Registry
    log: RequestLog
    store: StateStore
    limits: Limits

    def check_base(self, name: str | None) -> None: ...
    def submit(
        self, entry: Entry, work: Callable[[], Any], then: Callable[[Any], Any] = ...
    ) -> None: ...
    def refuse(self, entry: Entry, error: TinkerUserError) -> None: ...
    async def accept(
        self, request: web.Request, entry: Entry, reads_only: bool = False
    ) -> bool: ...


Handler = Callable[[web.Request, Service], Awaitable[web.StreamResponse]]


async def save_weights(request: web.Request, svc: Service) -> web.Response:
    body = await _body(request)
    model = svc.registry.model(str(body.get("model_id")))
    entry, fresh = svc.log.open(model.model_id, "train", body.get("seq_id"))

    def build() -> None:
        name = check_name(body.get("path"))
        overwrite = bool(body.get("overwrite"))
        if not overwrite and svc.store.exists(model.model_id, name):
            raise TinkerUserError(f"a state named {name!r} exists for {model.model_id!r}; "
                                  "pass overwrite=True to replace it")  # fmt: skip
        metadata = {str(k): str(v) for k, v in (body.get("user_metadata") or {}).items()}

        def work() -> str:
            tensors, optimizer, steps = svc.model.export_state(model.model_id)
            rank, attn, mlp, unembed = svc.model.lora_shape(model.model_id)
            meta = StateMeta(svc.base_name, rank, attn, mlp, unembed, steps, time.time(), metadata)
            return svc.store.save(model.model_id, name, meta, tensors, optimizer, overwrite)

        svc.submit(entry, work, lambda path: {"path": path, "type": "save_weights"})

    # It reads the adapter (and writes a file that outlives the server): a replay
    # answers a finished save from its record instead of saving again.
    await _submitted(svc, request, entry, fresh, build, reads_only=True)
    return _future(entry, model.model_id)


def _saved(svc: Service, body: dict[str, Any]) -> tuple[str, str, StateMeta]:
    """The state a load names, checked against this server's base model."""
    run_id, name = parse_path(body.get("path"))
    meta = svc.store.meta(run_id, name)
    svc.check_base(body.get("base_model") or meta.base_model)
    if meta.base_model != svc.base_name:
        raise TinkerUserError(f"state {body['path']!r} is of base model {meta.base_model!r}; "
                              f"this server serves {svc.base_name!r}")  # fmt: skip
    return run_id, name, meta


async def load_weights(request: web.Request, svc: Service) -> web.Response:
    body = await _body(request)
    optimizer = bool(body.get("optimizer"))
    if body.get("session_id") is not None:
        return await _create_via_load(request, svc, body, optimizer)
    model = svc.registry.model(str(body.get("model_id")))
    entry, fresh = svc.log.open(model.model_id, "train", body.get("seq_id"))

    def build() -> None:
        run_id, name, meta = _saved(svc, body)
        saved_shape = (meta.rank, meta.train_attn, meta.train_mlp, meta.train_unembed)
        if saved_shape != svc.model.lora_shape(model.model_id):
            raise TinkerUserError(
                f"state {body['path']!r} has LoRA (rank, attn, mlp, unembed) {saved_shape}; "
                f"this training client's is {svc.model.lora_shape(model.model_id)}"
            )

        def work() -> None:
            _, tensors, opt = svc.store.load(run_id, name, optimizer)
            svc.model.import_state(model.model_id, tensors, opt, meta.steps)

        def loaded(_: None) -> dict[str, Any]:
            model.steps = meta.steps
            return {"path": body["path"], "model_id": model.model_id, "type": "load_weights"}

        svc.submit(entry, work, loaded)

    await _submitted(svc, request, entry, fresh, build)
    return _future(entry, model.model_id)


async def _create_via_load(
    request: web.Request, svc: Service, body: dict[str, Any], optimizer: bool
) -> web.Response:
    """create_training_client_from_state: a new training client whose first request is
    the load; its LoRA shape is the saved state's."""
    session_id = str(body["session_id"])
    seq = int(body.get("model_seq_id", 0))
    svc.registry.session(session_id)
    model_id = Registry.model_id_for(session_id, seq)
    entry, fresh = svc.log.open(session_id, "create_model", seq)

    def build() -> None:
        run_id, name, meta = _saved(svc, body)
        check_rank(meta.rank, svc.limits)
        kind = (body.get("optimizer_config") or {}).get("type", "adamw")
        if kind != "adamw":
            raise TinkerUserError(f"optimizer_config type {kind!r}: only 'adamw' is served")
        if model_id in svc.registry.models:
            raise TinkerUserError(f"model {model_id!r} exists (model_seq_id {seq} reused)")

        def work() -> None:
            svc.model.add_adapter(
                model_id, meta.rank, None, meta.train_attn, meta.train_mlp, meta.train_unembed
            )
            _, tensors, opt = svc.store.load(run_id, name, optimizer)
            svc.model.import_state(model_id, tensors, opt, meta.steps)

        def registered(_: None) -> dict[str, Any]:
            svc.registry.add_model(TrainingModel(model_id, session_id, meta.rank, meta.steps))
            return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

        svc.submit(entry, work, registered)

    await _submitted(svc, request, entry, fresh, build)
    return _future(entry, model_id)


async def list_checkpoints(request: web.Request, svc: Service) -> web.Response:
    """RestClient.list_checkpoints: the run's saved states (this server's or an earlier
    one's: they are on disk). Sampler snapshots live in memory and are not listed."""
    run_id = request.match_info["model_id"]
    checkpoints = svc.store.list(run_id)
    if not checkpoints:
        svc.registry.model(run_id)  # a run nobody made: UnknownName (404)
    return web.json_response({"checkpoints": checkpoints, "cursor": None})


STATE_ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/api/v1/save_weights", save_weights),
    ("POST", "/api/v1/load_weights", load_weights),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints", list_checkpoints),
]

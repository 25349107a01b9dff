"""SGLang's LoRA routes on the CPU engine: /load_lora_adapter and /unload_lora_adapter
(`http_server.py`: 200 with `LoRAUpdateOutput` on success, 400 with it otherwise); the
adapters themselves are services/engine/loras.py's."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.engine.core.protocol import RequestError
from services.engine.http import json_route
from services.engine.state import EngineState


def _text(body: Any, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, str):
        raise RequestError(f"{key} (a string) is required")
    return value


@json_route
async def load_lora_adapter(request: web.Request, state: EngineState, body: Any) -> web.Response:
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    pinned = body.get("pinned", False)
    if not isinstance(pinned, bool):
        raise RequestError("pinned must be a boolean")
    out = await state.lora.load(name, path, pinned)
    return web.json_response(out, status=200 if out["success"] else 400)


@json_route
async def unload_lora_adapter(request: web.Request, state: EngineState, body: Any) -> web.Response:
    out = await state.lora.unload(_text(body, "lora_name"))
    return web.json_response(out, status=200 if out["success"] else 400)


def add_routes(r: web.UrlDispatcher) -> None:
    """Every release in the table serves both (whether LoRA is on or not)."""
    r.add_post("/load_lora_adapter", load_lora_adapter)
    r.add_post("/unload_lora_adapter", unload_lora_adapter)

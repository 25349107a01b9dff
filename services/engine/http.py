"""What every JSON route of the engine starts and ends with: the parsed body in, and
SGLang's error bodies out (`error`, `refusal`), written once for the native routes
(app.py, generate.py), the OpenAI-compatible ones (openai_api.py) and the rest."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.engine.core.protocol import RequestError
from services.engine.state import STATE, EngineState


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's `_create_error_response`: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=status)


def refusal(state: EngineState, e: RequestError) -> web.Response:
    """A refused /generate: schema errors as plain text from 0.5.22 (api_contract.py)."""
    if e.schema and state.caps.schema_errors_are_text:
        return web.json_response({"error": str(e)}, status=400)
    return error(str(e))


async def _json_body(request: web.Request) -> Any:
    if not request.can_read_body:
        return {}
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e


Route = Callable[[web.Request], Awaitable[web.Response]]
JsonHandler = Callable[[web.Request, EngineState, Any], Awaitable[web.Response]]


def json_route(handler: JsonHandler) -> Route:
    """What every route with a JSON body starts with, written once: the engine's state
    and the parsed body in, and a `RequestError` (raised anywhere in the handler) out as
    the 400 SGLang gives for it (`refusal`)."""

    @functools.wraps(handler)
    async def route(request: web.Request) -> web.Response:
        state = request.app[STATE]
        try:
            return await handler(request, state, await _json_body(request))
        except RequestError as e:
            return refusal(state, e)

    return route

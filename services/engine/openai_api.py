"""SGLang's OpenAI-compatible routes on the CPU engine: `/v1/completions`, `/v1/chat/completions`.

Each route turns the OpenAI request into the native /generate body
(core/openai_protocol.py), runs it exactly as /generate does (the same
request ids, scheduler, abort-on-disconnect) and answers in OpenAI's shape
with the token ids and per-token logprobs, so an agent written against an
OpenAI client can be trained on what it sampled. `/v1/models` lists the
served model, as SGLang's does.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.engine.core import openai_protocol as oa
from services.engine.core.protocol import RequestError
from services.engine.generate import native_generate
from services.engine.http import json_route
from services.engine.state import STATE, EngineState


def _model(state: EngineState) -> str:
    """SGLang's served model name (/v1/models) defaults to the model path."""
    return str(state.settings.model)


def _token_text(state: EngineState) -> Any:
    return lambda t: state.decode([t], False)


def _prompt_ids(state: EngineState, native: dict[str, Any]) -> list[int]:
    ids = native.get("input_ids")
    return list(ids) if ids is not None else state.encode(native["text"])


def _template(state: EngineState) -> Any:
    tok = state.tokenizer

    def apply(messages: list[Any]) -> list[int]:
        if not getattr(tok, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    return apply


@json_route
async def completions(request: web.Request, state: EngineState, body: Any) -> web.Response:
    native = oa.completion_request(body)
    out = await native_generate(request, state, native)
    if isinstance(out, web.Response):
        return out
    ids = _prompt_ids(state, native)
    return web.json_response(oa.completion_response(body, out[0], ids, _token_text(state)))


@json_route
async def chat_completions(request: web.Request, state: EngineState, body: Any) -> web.Response:
    native = oa.chat_request(body, _template(state), state.chat_defaults)
    out = await native_generate(request, state, native)
    if isinstance(out, web.Response):
        return out
    ids = native["input_ids"]
    return web.json_response(oa.chat_response(body, out[0], ids, _token_text(state)))


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": _model(state),
        "object": "model",
        "created": int(state.started),
        "owned_by": "sglang",
        "root": _model(state),
        "parent": None,
        "max_model_len": state.context_len,
    }
    adapters = state.lora.model_cards(_model(state), int(state.started))
    return web.json_response({"object": "list", "data": [card, *adapters]})


def add_routes(r: web.UrlDispatcher) -> None:
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_get("/v1/models", models)

"""/generate: parse the request, claim its ids, run its sequences on the scheduler
thread, answer in SGLang's shape. Its own module because the OpenAI-compatible routes
(openai_api.py) run the same path (`native_generate`) and app.py wires both."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from typing import Any

from aiohttp import web

from services.engine.core.lora import LoraError
from services.engine.core.protocol import (
    Completion,
    ParsedGenerate,
    SeqSpec,
    parse_generate,
    response,
    trim_text,
)
from services.engine.http import error, json_route
from services.engine.scheduler import SchedulerStopped
from services.engine.state import EngineState


async def run_seqs(state: EngineState, seqs: list[SeqSpec]) -> list[Completion]:
    """Submit sequences and await all; abort them if the caller is cancelled."""
    handoff = state.handoff()
    futures: list[asyncio.Future[Completion]] = []
    for spec in seqs:
        fut: asyncio.Future[Completion] = handoff.loop.create_future()
        state.scheduler.submit(spec, functools.partial(handoff.put, fut))
        futures.append(fut)
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:
        for rid in {s.rid for s in seqs}:
            state.scheduler.abort(rid)
        raise


def claim_rids(state: EngineState, parsed: ParsedGenerate) -> dict[str, asyncio.Event] | str:
    """Register the request's ids as in flight, or the duplicate error SGLang gives.

    Before 0.5.10 SGLang took a duplicate id over (`rid_to_state[rid] = ...`)
    and the earlier request never got an answer: its event is set.
    """
    ids = parsed.held + parsed.claimed
    if len(set(ids)) != len(ids) and state.caps.rejects_duplicate_rid:
        dups = sorted({r for r in ids if ids.count(r) > 1})
        return f"Duplicate request IDs detected within the request: {dups}"
    for rid in ids:
        if rid in state.in_flight:
            if state.caps.rejects_duplicate_rid:
                return state.caps.duplicate_rid_message(rid)
            state.in_flight[rid].set()
    mine = {rid: asyncio.Event() for rid in parsed.held}
    state.in_flight.update(mine)
    return mine


@json_route
async def generate(request: web.Request, state: EngineState, body: Any) -> web.Response:
    out = await native_generate(request, state, body)
    if isinstance(out, web.Response):
        return out
    outs, as_list = out
    return web.json_response(outs if as_list else outs[0])


async def native_generate(
    request: web.Request, state: EngineState, body: Any
) -> web.Response | tuple[list[dict[str, Any]], bool]:
    """/generate's work: the answers (and whether they are a list), or an error response.
    Also what the OpenAI-compatible routes run (services/engine/openai_api.py)."""
    parsed = parse_generate(
        body,
        state.encode,
        state.vocab_size,
        state.context_len,
        state.settings.default_max_new_tokens,
        state.caps,
    )
    mine = claim_rids(state, parsed)
    if isinstance(mine, str):
        return error(mine)
    state.requests[id(request)] = request
    loras: list[str | None] = []
    try:
        loras = await state.lora.acquire(parsed.lora_names, body.get("lora_path"))
        seqs = [replace(s, lora_id=i) for s, i in zip(parsed.seqs, loras, strict=True)]
        done = await run_seqs(state, seqs)
    except LoraError as e:
        return error(str(e))
    except SchedulerStopped as e:
        return error(str(e), 503)
    finally:
        state.lora.release(loras)
        state.requests.pop(id(request), None)
        for rid, ev in mine.items():
            if state.in_flight.get(rid) is ev:
                del state.in_flight[rid]
    if any(ev.is_set() for ev in mine.values()):
        await asyncio.Event().wait()  # taken over: SGLang never answers this request
    reported = state.scheduler.weight_version
    out = []
    for spec, c in zip(parsed.seqs, done, strict=True):
        text = trim_text(
            state.decode(c.output_ids, spec.params.skip_special_tokens),
            spec.params,
            c.matched_stop_str,
        )
        out.append(response(spec, c, text, reported_version=reported, caps=state.caps))
    return out, parsed.as_list

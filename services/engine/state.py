"""What the engine's HTTP handlers share (one object per server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.engine.handoff import Handoff
from services.engine.loras import Loras
from services.engine.probes import Health
from services.engine.scheduler import Scheduler
from services.engine.settings import EngineSettings
from services.engine_api.sglang_api import Capabilities


@dataclass
class EngineState:
    """Settings, tokenizer, scheduler, the emulated release, LoRA adapters, and the
    requests in flight.

    `in_flight` maps each request id answered under its own name to an event
    set when a later request took the id over (SGLang before 0.5.10 let it;
    the earlier request then never gets its answer).
    """

    settings: EngineSettings
    tokenizer: Any
    scheduler: Scheduler
    vocab_size: int
    context_len: int
    model_path: str
    started: float
    caps: Capabilities
    health: Health
    lora: Loras
    # /v1/chat/completions' sampling defaults from generation_config.json (SGLang's
    # --sampling-defaults model; empty with "openai" or no file).
    chat_defaults: dict[str, Any] = field(default_factory=dict)
    in_flight: dict[str, asyncio.Event] = field(default_factory=dict)
    requests: dict[int, web.Request] = field(default_factory=dict)  # open /generate calls
    on_crash: Callable[[str], None] | None = None  # the scheduler died: the server must go too
    # Memory tags /release_memory_occupation recorded and no resume took back yet
    # (services/engine/memory_api.py): SGLang's scheduler's `offload_tags`.
    released: set[str] = field(default_factory=set)
    _handoff: Handoff | None = field(default=None, init=False, repr=False)

    def handoff(self) -> Handoff:
        """Where the scheduler thread hands completions to the running loop."""
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = Handoff(loop)
        return self._handoff

    def crash(self, why: str) -> None:
        """The scheduler died: drop every open generation's connection, as SGLang's dying
        process does (no answer), then tell the server."""
        for request in list(self.requests.values()):
            if request.transport is not None:
                request.transport.close()
        if self.on_crash is not None:
            self.on_crash(why)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


STATE: web.AppKey[EngineState] = web.AppKey("engine_state", EngineState)

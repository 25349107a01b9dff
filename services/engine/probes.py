"""Health, readiness and the API key, as SGLang's HTTP server answers them.

Read from SGLang's `entrypoints/http_server.py` (`health_generate`, `ready`,
`sagemaker_health`) and `utils/auth.py` (0.5.23; `utils/common.py` before),
and answered the same way, never more kindly, so a probe that would kill an
SGLang container kills this engine too:

- `/health` and `/health_generate` submit a one-token generation, sleep a
  second, and answer 200 once *any* output arrived after the check began
  (so they take at least 1 s), or 503 after the health-check timeout (20 s
  by default). While generation is paused no output comes: 503. From 0.5.6
  `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false` makes `/health` (only)
  answer 200 at once.
- `/ping` is 200 (from 0.5.23: 503 while the last health check failed);
  `/ready` (0.5.20+) is 503 while paused or unhealthy.
- With an API key, every path but `/health*`, `/ready*` and `/metrics*`
  needs `Authorization: Bearer <key>`; otherwise 401 `{"error": "Unauthorized"}`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from services.engine.core.protocol import Completion, SamplingParams, SeqSpec
from services.engine_api.sglang_api import Capabilities

if TYPE_CHECKING:
    from services.engine.scheduler import Scheduler

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

EXEMPT_PREFIXES = ("/health", "/metrics")
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


def api_key_middleware(key: str, caps: Capabilities) -> Any:
    """SGLang's key check: constant-time compare of the Bearer token on every guarded path."""
    exempt = (*EXEMPT_PREFIXES, "/ready") if caps.has_ready else EXEMPT_PREFIXES

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path.startswith(exempt):
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return middleware


class Health:
    """The engine's health state: SGLang's `server_status` (Up / UnHealthy)."""

    def __init__(self, caps: Capabilities, generation: bool, timeout_s: float) -> None:
        self.caps = caps
        self.generation = generation
        self.timeout_s = timeout_s
        self.healthy = True

    async def check(
        self,
        path: str,
        submit: Callable[[SeqSpec, Callable[[Completion], None]], None],
        abort: Callable[[str], Any],
        last_output: Callable[[], float],
        alive: bool,
    ) -> int:
        """The status `/health` or `/health_generate` answers."""
        if not alive:
            return 503
        if path == "/health" and not self.generation and self.caps.has_cheap_health_switch:
            return 200
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        spec = SeqSpec(rid, (0,), SamplingParams(max_new_tokens=1, temperature=0.0), False)
        tic = time.time()
        submit(spec, lambda _c: None)
        try:
            while time.time() < tic + self.timeout_s:
                await asyncio.sleep(1)
                if last_output() > tic:
                    self.healthy = True
                    return 200
        finally:
            abort(rid)
        self.healthy = False
        return 503


async def status_only(status: int) -> web.Response:
    return web.Response(status=status)


WATCH_S = 0.5  # how often the server checks that the scheduler thread is alive


async def watch_scheduler(
    sched: Scheduler, on_crash: Callable[[str], None], stop: asyncio.Event
) -> None:
    """Exit with the scheduler thread, however it ended: an HTTP server up in front
    of a dead scheduler answers 503s that nobody restarts it for (SGLang's server
    dies with its scheduler process, and its pod is restarted)."""
    while not stop.is_set():
        await asyncio.sleep(WATCH_S)
        if not sched.alive():
            on_crash(sched.crashed or "the engine scheduler stopped")
            return

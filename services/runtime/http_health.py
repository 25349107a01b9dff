"""The metrics + health HTTP server every service runs on its own port.

- `/metrics`: the Prometheus text format of the service's *own*
  `CollectorRegistry`. Not the process-global default registry: tests run
  several services in one process, and each must expose only its metrics.
- `/healthz`: liveness. 200 while the event loop answers at all; Kubernetes
  restarts the pod when it stops answering.
- `/readyz`: readiness. 200 only when every named condition holds (NATS
  connected, streams ensured, whatever the service adds); otherwise 503 with
  a JSON body naming each unmet condition, so `kubectl describe` and a human
  with curl see *why*.

Readiness is a small state object (`Readiness`) rather than one callback, so
the runtime and the service can each own their conditions without knowing
about the other's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.runtime.errors import FlywheelError

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client import CollectorRegistry


class HealthServerError(FlywheelError, RuntimeError):
    """The health server could not bind or was used before start()."""


class Readiness:
    """Named readiness conditions. A condition is unmet while it has a reason.

    Static conditions are set with `set(name, reason)` (None = met); dynamic
    ones are functions evaluated on every `/readyz` (e.g. "is NATS connected
    right now"), returning None when met or the reason when not.
    """

    def __init__(self) -> None:
        self._static: dict[str, str | None] = {}
        self._checks: dict[str, Callable[[], str | None]] = {}

    def set(self, name: str, reason: str | None) -> None:
        self._static[name] = reason

    def ok(self, name: str) -> None:
        self._static[name] = None

    def check(self, name: str, fn: Callable[[], str | None]) -> None:
        self._checks[name] = fn

    def problems(self) -> dict[str, str]:
        """Unmet conditions by name; empty when ready."""
        out = {n: r for n, r in self._static.items() if r is not None}
        for name, fn in self._checks.items():
            reason = fn()
            if reason is not None:
                out[name] = reason
        return out

    @property
    def ready(self) -> bool:
        return not self.problems()


class HealthServer:
    """aiohttp server for /metrics, /healthz, /readyz. `port=0` binds a free port."""

    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: Readiness,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        service: str = "",
    ) -> None:
        self.registry = registry
        self.readiness = readiness
        self.host = host
        self._port = port
        self.service = service
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with 0, once started)."""
        if self._port == 0:
            raise HealthServerError("health server not started: no port bound yet")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        return app

    async def start(self) -> HealthServer:
        from aiohttp import web

        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise HealthServerError(f"cannot bind {self.host}:{self._port}: {e}") from e
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> HealthServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.json_response({"status": "ok", "service": self.service})

    async def _readyz(self, request: web.Request) -> web.Response:
        from aiohttp import web

        problems = self.readiness.problems()
        body = {"ready": not problems, "service": self.service, "unmet": problems}
        return web.Response(
            text=json.dumps(body), status=503 if problems else 200, content_type="application/json"
        )

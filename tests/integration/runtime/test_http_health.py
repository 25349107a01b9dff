"""The metrics + health server over real HTTP, and run_service end to end."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from proto.codec import encode
from proto.examples import EXAMPLES
from proto.messages import SampleGroup
from proto.streams import consumers_for
from proto.subjects import Subjects
from services.runtime.http_health import HealthServer, Readiness
from services.runtime.lifecycle import ServiceContext, run_service
from services.runtime.settings import NatsSettings, ServiceSettings


async def get(url: str) -> tuple[int, str]:
    """GET in a thread (urllib), so the server on this loop can answer."""

    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.to_thread(fetch)


def test_endpoints_and_readiness_flip(run_async):
    async def body():
        registry = CollectorRegistry()
        Counter("flywheel_test_events", "Test events.", registry=registry).inc(3)
        readiness = Readiness()
        readiness.set("nats", "connecting")
        async with HealthServer(registry, readiness, port=0, service="svc") as server:
            assert server.port > 0
            status, text = await get(f"{server.url}/healthz")
            assert status == 200 and json.loads(text)["service"] == "svc"

            status, text = await get(f"{server.url}/readyz")
            assert status == 503
            assert json.loads(text)["unmet"] == {"nats": "connecting"}

            readiness.ok("nats")
            connected = [False]
            readiness.check("engine", lambda: None if connected[0] else "no engine")
            status, text = await get(f"{server.url}/readyz")
            assert status == 503 and json.loads(text)["unmet"] == {"engine": "no engine"}
            connected[0] = True
            status, text = await get(f"{server.url}/readyz")
            assert status == 200 and json.loads(text)["ready"] is True

            status, text = await get(f"{server.url}/metrics")
            assert status == 200
            families = {f.name: f for f in text_string_to_metric_families(text)}
            (sample,) = [
                s for s in families["flywheel_test_events"].samples if s.name.endswith("_total")
            ]
            assert sample.value == 3.0
            # only this service's registry: nothing from the global default one
            assert not any(name.startswith("process_") for name in families)

    run_async(body())


def test_run_service_connects_serves_and_drains(nats_server, run_async, eventually):
    run = "svc"

    async def body():
        settings = ServiceSettings(
            run=run, nats=NatsSettings(url=nats_server.url, connect_attempts=3)
        )
        stop = asyncio.Event()
        handled: list[str] = []
        ctx_box: list[ServiceContext] = []

        async def service_body(ctx: ServiceContext) -> None:
            ctx_box.append(ctx)

            async def handle(group: SampleGroup, d) -> None:
                handled.append(group.group_id)

            await ctx.consume(
                consumers_for(run)["buffer"], SampleGroup, handle, fetch_timeout_s=0.2
            )

        service = asyncio.create_task(
            run_service("buffer", settings, service_body, stop=stop, handle_signals=False)
        )
        await eventually(lambda: bool(ctx_box) and ctx_box[0].readiness.ready)
        ctx = ctx_box[0]
        assert ctx.max_payload == 1024 * 1024
        status, _ = await get(f"{ctx.health.url}/readyz")
        assert status == 200

        await ctx.js.publish(Subjects(run).samples, encode(EXAMPLES["SampleGroup"]))
        await eventually(lambda: handled == [EXAMPLES["SampleGroup"].group_id])
        _, text = await get(f"{ctx.health.url}/metrics")
        assert 'flywheel_messages_handled_total{service="buffer"' in text

        stop.set()
        await asyncio.wait_for(service, 10)
        assert ctx.nc.is_closed
        # the health server is gone with the service
        try:
            await get(f"{ctx.health.url}/healthz")
        except OSError:
            pass
        else:
            raise AssertionError("health server still answering after stop")

    run_async(body())

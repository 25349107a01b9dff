"""Graceful shutdown of a real service process, and run_service's error paths."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import pytest

from services.runtime.lifecycle import ServiceContext, run_service
from services.runtime.settings import NatsSettings, ServiceSettings
from tests.harness import REPO

SERVICE = textwrap.dedent(
    """
    import asyncio, sys
    from services.runtime.lifecycle import run_service, setup_logging
    from services.runtime.settings import NatsSettings, ServiceSettings

    async def body(ctx):
        print(f"ready {ctx.health.url}", flush=True)
        await ctx.stop.wait()
        await ctx.js.publish("flywheel.sig.batches", b"last words")  # drained before exit
        print("body done", flush=True)

    setup_logging("sigsvc", "INFO")
    settings = ServiceSettings(run="sig", nats=NatsSettings(url=sys.argv[1]))
    asyncio.run(run_service("sigsvc", settings, body))
    """
)


def test_sigterm_stops_the_service_cleanly(nats_server, run_async):
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE, nats_server.url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready http://127.0.0.1:"), line
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "body done" in out
    assert "received SIGTERM; stopping" in err and "sigsvc: stopped" in err
    assert " sigsvc INFO " in err  # the one-line log format

    async def count() -> int:
        import nats

        nc = await nats.connect(nats_server.url)
        try:
            info = await nc.jetstream().stream_info("FLYWHEEL_sig_BATCHES")
            return int(info.state.messages)
        finally:
            await nc.close()

    assert run_async(count()) == 1  # the publish made during shutdown was not lost


def settings_for(url: str) -> ServiceSettings:
    return ServiceSettings(run="errs", nats=NatsSettings(url=url, connect_attempts=3))


def test_a_failing_body_stops_the_service_and_propagates(nats_server, run_async):
    seen: list[ServiceContext] = []

    async def body(ctx: ServiceContext) -> None:
        seen.append(ctx)
        raise RuntimeError("broken service")

    with pytest.raises(RuntimeError, match="broken service"):
        run_async(run_service("bad", settings_for(nats_server.url), body, handle_signals=False))
    assert seen[0].nc.is_closed and seen[0].stop.is_set()


def test_a_body_that_ignores_stop_is_cancelled_after_the_grace_period(
    nats_server, run_async, eventually
):
    cancelled: list[bool] = []
    started: list[bool] = []

    async def stubborn(ctx: ServiceContext) -> None:
        started.append(True)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        stop = asyncio.Event()
        service = asyncio.create_task(
            run_service(
                "stubborn",
                settings_for(nats_server.url),
                stubborn,
                stop=stop,
                grace_s=0.2,
                handle_signals=False,
            )
        )
        await eventually(lambda: bool(started))
        stop.set()
        await asyncio.wait_for(service, 10)

    run_async(main())
    assert cancelled == [True]

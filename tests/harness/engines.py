"""The CPU engine (Flywheel's stand-in for SGLang) for tests: in this process, or its own.

In this process (`EngineStates`, `serving`): the engine's state (model and
scheduler thread) made once per configuration and served by aiohttp on a
free loopback port inside the test's event loop; a test then costs a model
load, not a process start. As a subprocess (`start_engine`): the real
entry point, `python -m <ENGINE_MODULE>`, polled on /health_generate (a
one-token generation, as SGLang's probe is) until it answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness import REPO
from tests.harness.ports import free_port
from tests.harness.probe import http_ok

ENGINE_MODULE = "services.engine"  # what `python -m` runs (flywheel engine)


class EngineStates:
    """CPU engine states for one model, one per distinct set of EngineSettings options
    (an emulated SGLang release, an API key, …), made on demand; `close()` stops them."""

    def __init__(self, model: Path, **defaults: Any) -> None:
        self.model = model
        self.defaults = {"weight_version": "0", **defaults}
        self.states: dict[tuple[tuple[str, str], ...], Any] = {}

    def get(self, **options: Any) -> Any:
        from services.engine.app import create_state
        from services.engine.settings import EngineSettings
        from services.runtime.settings import load_settings

        opts = {"model": self.model, **self.defaults, **options}
        key = tuple(sorted((k, str(v)) for k, v in opts.items()))
        if key not in self.states:
            self.states[key] = create_state(load_settings(EngineSettings, **opts))
        return self.states[key]

    def close(self) -> None:
        for state in self.states.values():
            state.scheduler.stop()


@asynccontextmanager
async def serving(app: Any, port: int = 0) -> AsyncIterator[str]:
    """Serve an aiohttp app on 127.0.0.1 (`port` 0: a free one); yields its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serving_engine(state: Any) -> AsyncIterator[str]:
    """The engine's HTTP API (services/engine/app.py) over `state`."""
    from services.engine.app import build_app

    async with serving(build_app(state)) as url:
        yield url


@dataclass
class EngineProcess:
    url: str
    model_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_engine(
    model_dir: Path, log_path: Path, *extra: str, timeout_s: float = 60.0, port: int | None = None
) -> EngineProcess:
    """Start the engine's entry point on `port` (None: a free one); return once
    /health_generate is 200."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-m", ENGINE_MODULE, "--model", str(model_dir), "--port", str(port),
            *extra]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not http_ok(f"{url}/health_generate"):
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"engine did not become healthy:\n{log_path.read_text()}")
        time.sleep(0.1)
    return EngineProcess(url, model_dir, proc, log_path)


def stop_engine(engine: EngineProcess) -> None:
    engine.proc.terminate()
    try:
        engine.proc.wait(10)
    except subprocess.TimeoutExpired:
        engine.proc.kill()
        engine.proc.wait(5)

"""A real CPU engine server, started as a subprocess on a free port, for a test module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.tiny_model import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EngineProcess:
    url: str
    model_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_engine(
    model_dir: Path, log_path: Path, *extra: str, timeout_s: float = 60.0
) -> EngineProcess:
    """Start `python -m services.engine` and poll /health_generate until it answers.

    Like SGLang's, the probe generates a token and takes at least a second.
    """
    port = free_port()
    log_file = log_path.open("wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.engine",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            *extra,
        ],
        cwd=REPO,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
    )
    log_file.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as resp:
                if resp.status == 200:
                    return EngineProcess(url, model_dir, proc, log_path)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet; poll again until the deadline
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"engine did not become healthy:\n{log_path.read_text()}")
        time.sleep(0.1)


def stop_engine(engine: EngineProcess) -> None:
    engine.proc.terminate()
    try:
        engine.proc.wait(10)
    except subprocess.TimeoutExpired:
        engine.proc.kill()
        engine.proc.wait(5)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "m", TinyModelSpec())


@pytest.fixture(scope="module")
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    eng = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    yield eng
    stop_engine(eng)

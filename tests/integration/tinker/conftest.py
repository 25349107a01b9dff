"""A real Tinker server (`python -m services.tinker`, the tiny model) in a subprocess on a
free port, and the real `tinker` SDK pointed at it. Skips, saying why, where the
`tinker` extra is not installed (`make setup` installs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.poll import wait_for
from tests.harness.ports import free_port

pytest.importorskip(
    "tinker", reason="the `tinker` extra is not installed (pip install '.[tinker]')"
)
pytest.importorskip("peft", reason="the `lora` extra is not installed (pip install '.[lora]')")

MAX_TOKENS = 48  # the server's [tinker] max_tokens: small, so an oversized datum is cheap
MAX_NUM_SAMPLES = 8


@dataclass
class Server:
    base_url: str
    model_dir: Path
    model_name: str
    process: subprocess.Popen[bytes]
    log: Path

    def tokens(self, text: str) -> list[int]:
        from transformers import AutoTokenizer

        return list(AutoTokenizer.from_pretrained(self.model_dir).encode(text))


def _healthy(base_url: str, process: subprocess.Popen[bytes], log: Path) -> bool:
    import httpx

    if process.poll() is not None:
        raise AssertionError(f"the tinker server exited {process.returncode}:\n{log.read_text()}")
    try:
        return httpx.get(f"{base_url}/api/v1/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def serving(
    model: Path, root: Path, port: int | None = None, **settings: str
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """`python -m services.tinker` on `model`, one torch thread, its log and saved states
    under `root` (never the repository's runs/), `settings` as FLYWHEEL_TINKER_* variables,
    on `port` (default: a free one); yields (its URL, the process, its log, appended to by
    every server started on `root`)."""
    port = port or free_port()
    log = root / "server.log"
    env = {
        **os.environ,
        # The tiny model's matmuls are too small for a thread team: on a shared box its
        # threads spin on cores the SDK's process and others hold (seconds per step).
        "FLYWHEEL_TINKER_NUM_THREADS": "1",
        "FLYWHEEL_TINKER_STATE_DIR": str(root / "state"),  # save_state's files
        **{f"FLYWHEEL_TINKER_{k.upper()}": v for k, v in settings.items()},
    }
    cmd = [sys.executable, "-m", "services.tinker", "--model", str(model), "--port", str(port)]
    with log.open("ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(base_url, process, log), 120, "the tinker server's /healthz")
        yield base_url, process, log
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="package")  # one server for the package: its start is most of the time
def tinker_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    limits = {"max_tokens": str(MAX_TOKENS), "max_num_samples": str(MAX_NUM_SAMPLES)}
    with serving(tiny_model, tmp_path_factory.mktemp("tinker"), **limits) as (url, proc, log):
        yield Server(url, tiny_model, tiny_model.name, proc, log)


@pytest.fixture(autouse=True)
def _sdk_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK wants a key shaped like Tinker's; telemetry off (it would post usage events).
    monkeypatch.setenv("TINKER_API_KEY", "tml-flywheel-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@pytest.fixture
def service_client(tinker_server: Server) -> Iterator[Any]:
    import tinker

    client = tinker.ServiceClient(base_url=tinker_server.base_url)
    yield client
    client.close("success").result(timeout=30)

"""`flywheel up` as a user runs it: a systematic error stops the run; `status -c` and an
added worker find a running run from its run file alone.

Real everything: `python -m services up -c run.toml` (embedded NATS, one CPU
engine with its worker, sync, trainer, buffer), then the README's commands,
with nothing but the run file and the two variables the README names.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.common.tiny_model import write_tiny_model
from tests.harness import REPO

ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_toml(tmp: Path, model: Path, reward: str, run: str) -> Path:
    p = tmp / "run.toml"
    p.write_text(f"""
run = "{run}"

[stack]
run_dir = "{tmp / "run"}"
model = "{model}"
engines = 1
engine_threads = 1
on_failure = "stop"
status_interval_s = 1

[task]
source = {{ type = "arithmetic", digits = 1 }}
reward = "{reward}"

[buffer]
samples_per_prompt = 4
groups_per_step = 2
max_new_tokens = 4
filter_zero_variance = false
dispatch_interval_s = 0.1

[rollout]
concurrency = 4
heartbeat_s = 0.3

[trainer.runtime]
cpu_threads = 1

[sync]
tick_s = 0.1
""")
    return p


def flywheel(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "services", *args],
        cwd=REPO,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services", *args],
        cwd=REPO,
        env=env or ENV,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_line(log: Path, pattern: str, timeout_s: float, proc: subprocess.Popen) -> float:
    """Poll `log` until a line matches; the time it was seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text(errors="replace")):
            return time.monotonic()
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {log}:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


@pytest.mark.slow
def test_every_task_failing_the_same_way_stops_the_run(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model")
    config = run_toml(tmp_path, model, "tests.unit.tasks.fixtures:raises", "failfast")
    log = tmp_path / "up.log"
    up = start(["up", "-c", str(config)], log)
    try:
        ready = wait_line(log, "all services ready", 180, up)
        code = up.wait(60)
        stopped = time.monotonic()
    finally:
        stop(up)
    out = log.read_text()
    assert code != 0, out[-3000:]
    assert "buffer stopped the run" in out and "ValueError: reward bug" in out, out[-3000:]
    assert "16 tasks in a row failed the same way" in out
    assert stopped - ready < 30, f"{stopped - ready:.1f}s after ready"
    assert not (tmp_path / "run" / "run.json").exists()  # the record goes with the run


@pytest.mark.slow
def test_status_and_an_added_worker_find_the_running_run(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model")
    config = run_toml(tmp_path, model, "exact_match", "attach")
    up_log, extra = tmp_path / "up.log", []
    up = start(["up", "-c", str(config)], up_log)
    try:
        wait_line(up_log, "all services ready", 180, up)
        s = json.loads(flywheel("status", "-c", str(config), "--json").stdout)
        assert s["run"] == "attach" and "engine-0" in s["engines"]
        # The README's recipe, as written: an engine, and a worker told only its engine.
        port = free_port()
        extra.append(
            start(["engine", "--model", str(model), "--port", str(port)], tmp_path / "engine.log")
        )
        env = {
            **ENV,
            "FLYWHEEL_ROLLOUT_ENGINE_URL": f"http://127.0.0.1:{port}",
            "FLYWHEEL_ROLLOUT_ENGINE_ID": "engine-extra",
        }
        extra.append(start(["rollout", "-c", str(config)], tmp_path / "worker.log", env))
        deadline = time.monotonic() + 120
        while True:  # sync brought the new engine to the run's weights; its worker works
            s = json.loads(flywheel("status", "-c", str(config), "--json").stdout)
            e = s["engines"].get("engine-extra")
            if e and e["version"] >= 1 and e["version"] >= (s["ready"] or 0) - 1:
                break
            assert time.monotonic() < deadline, (s, (tmp_path / "worker.log").read_text()[-3000:])
            time.sleep(1)
    finally:
        for p in extra:
            stop(p, signal.SIGTERM)
        code = stop(up)
    assert code == 0, up_log.read_text()[-3000:]
    worker_log = (tmp_path / "worker.log").read_text()
    assert "connected to 127.0.0.1" in worker_log and "Traceback" not in worker_log
    gone = flywheel("status", "-c", str(config))
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1, gone.stderr
    assert "no run is up" in gone.stderr and not gone.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

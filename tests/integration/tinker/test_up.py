"""`flywheel up -c` a Tinker-only run file (configs/examples/tinker.toml's shape, on the
tiny model): the real command starts a CPU engine with LoRA and the Tinker server on it,
prints the URL to give the SDK, serves a forward_backward and a sample from the trained
adapter (on the engine), and stops cleanly on SIGINT, every process gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.harness import REPO
from tests.harness.ports import free_port

EXAMPLE = REPO / "configs" / "examples" / "tinker.toml"


def _run_file(tmp: Path, model: Path, port: int) -> Path:
    text = EXAMPLE.read_text()
    text = text.replace('"runs/tinker"', f'"{tmp / "run"}"')
    text = text.replace('"~/.cache/flywheel/models/SmolLM2-135M-Instruct"', f'"{model}"')
    text = text.replace("port = 8000 ", f"port = {port} ")
    text = text.replace("max_lora_rank = 64 ", "max_lora_rank = 8 ")
    assert str(model) in text and f"port = {port}" in text
    path = tmp / "tinker.toml"
    path.write_text(text)
    return path


def _wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"flywheel up exited {proc.wait()}:\n{''.join(seen)}")
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} line in {timeout_s} s:\n{''.join(seen)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_training_and_sampling_on_its_engine(
    tiny_model: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    import tinker
    from tinker import types

    monkeypatch.setenv("TINKER_API_KEY", "tml-flywheel-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    port = free_port()
    config = _run_file(tmp_path, tiny_model, port)
    cmd = [sys.executable, "-m", "services", "up", "-c", str(config), "--no-check"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        line = _wait_for_line(proc, "flywheel up: Tinker API at", 180)
        url = f"http://127.0.0.1:{port}"
        assert url in line
        pids = json.loads((tmp_path / "run" / "pids.json").read_text())
        assert set(pids) == {"engine-0", "tinker"}  # a Tinker-only run: nothing else

        client = tinker.ServiceClient(base_url=url)
        training = client.create_lora_training_client(
            base_model=tiny_model.name, rank=4, seed=1
        ).result(timeout=120)
        tokens = list(range(5, 20))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)},
        )
        losses = []
        for _ in range(3):
            fb = training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
            losses.append(fb.result(timeout=120).metrics["loss:sum"])
        assert losses[-1] < losses[0]
        sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
        params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        out = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 2, params).result(120)
        assert [len(s.tokens) for s in out.sequences] == [6, 6]
        assert all(len(s.logprobs or []) == 6 for s in out.sequences)
        client.close("success").result(timeout=30)
        # The sample ran on the engine: its log has the adapter the server loaded.
        engine_log = (tmp_path / "run" / "logs" / "engine-0.log").read_text()
        assert "LoRA adapter tinker-" in engine_log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0
    assert not any(_alive(pid) for pid in pids.values())

"""save_state / load_state through the real SDK, across a real server restart: a
training client's state saved, the server SIGKILLed and started again on the same
`state_dir`, then loaded into new training clients, continues training exactly
where an uninterrupted twin went; loading without the optimizer resets AdamW."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.harness.poll import wait_for
from tests.harness.ports import free_port
from tests.integration.tinker.conftest import Server, _healthy

LR = 1e-2


def _start(
    model: Path, state_dir: Path, log: Path, started: list[subprocess.Popen[bytes]]
) -> tuple[str, subprocess.Popen[bytes]]:
    """A server, in `started` before its wait: one whose /healthz never answers is
    stopped by the fixture too (it was left running)."""
    port = free_port()
    env = {
        **os.environ,
        "FLYWHEEL_TINKER_STATE_DIR": str(state_dir),
        "FLYWHEEL_TINKER_NUM_THREADS": "1",  # as conftest's server: and the same on both runs
    }
    cmd = [sys.executable, "-m", "services.tinker", "--model", str(model), "--port", str(port)]
    with log.open("ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    started.append(process)
    base_url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _healthy(base_url, process, log), 120, "the tinker server's /healthz")
    return base_url, process


@pytest.fixture
def servers(tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    """start() -> (base_url, process) of a server on tmp_path's state dir; all stopped after."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[str, subprocess.Popen[bytes]]:
        return _start(tiny_model, tmp_path / "state", tmp_path / "server.log", started)

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def _data(tokenizer: Any) -> list[Any]:
    from tinker import types

    data = []
    for text in ("the cat sat on the mat", "a dog ran to the park"):
        ids = list(tokenizer.encode(text))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": np.asarray(ids[1:], dtype=np.int64)},
            )
        )
    return data


def _step(client: Any, data: list[Any]) -> float:
    """One forward_backward + optim_step; the loss forward_backward saw."""
    from tinker import types

    fb = client.forward_backward(data, "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=LR)).result(timeout=60)
    return float(fb.result(timeout=60).metrics["loss:sum"])


def _loss(client: Any, data: list[Any]) -> float:
    return float(client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"])


@pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning")  # load_state: still sent
def test_a_saved_state_continues_exactly_after_a_server_restart(servers: Any) -> None:
    import tinker

    # -- before: 3 steps, save, then the twin's step 4 --------------------------------
    first, first_process = servers()
    service = tinker.ServiceClient(base_url=first)
    training = service.create_lora_training_client(base_model="model", rank=4, seed=1).result(
        timeout=60
    )
    data = _data(training.get_tokenizer())
    losses = [_step(training, data) for _ in range(3)]
    assert losses[2] < losses[0]  # it trains: the state saved is not the base's
    saved = training.save_state("step3", user_metadata={"note": "three steps"}).result(timeout=60)
    assert saved.path == f"tinker://{training.model_id}/weights/step3"
    twin_fb = _step(training, data)  # step 4's loss: a function of the saved weights
    twin_after = _loss(training, data)  # after step 4: of the weights and AdamW's moments too
    listed = tinker.RestClient(base_url=first).list_checkpoints(training.model_id).result(30)
    assert [(c.tinker_path, c.checkpoint_type) for c in listed.checkpoints] == [
        (saved.path, "training")
    ]
    assert listed.checkpoints[0].user_metadata == {"note": "three steps"}
    # A second save under the name without overwrite is refused; nothing is replaced.
    with pytest.raises(tinker.RequestFailedError, match="overwrite=True"):
        training.save_state("step3").result(timeout=60)

    # -- the server dies (no shutdown path runs) and a new one starts ------------------
    first_process.send_signal(signal.SIGKILL)
    first_process.wait(10)
    second, _ = servers()
    service2 = tinker.ServiceClient(base_url=second)

    # With the optimizer: step 4 again gives the twin's losses, bit for bit.
    restored = service2.create_training_client_from_state_with_optimizer(saved.path).result(60)
    assert restored.get_info().lora_rank == 4
    assert _step(restored, data) == twin_fb
    assert _loss(restored, data) == twin_after

    # The legacy route (a fresh client, then load_state_with_optimizer) does the same.
    legacy = service2.create_lora_training_client(base_model="model", rank=4).result(60)
    legacy.load_state_with_optimizer(saved.path).result(timeout=60)
    assert _step(legacy, data) == twin_fb
    assert _loss(legacy, data) == twin_after

    # Weights only: the same weights, a fresh AdamW, so step 4 moves them elsewhere.
    weights_only = service2.create_training_client_from_state(saved.path).result(60)
    assert _step(weights_only, data) == twin_fb
    assert abs(_loss(weights_only, data) - twin_after) > 1e-3

    # The restarted server lists the earlier server's run from disk.
    relisted = tinker.RestClient(base_url=second).list_checkpoints(training.model_id).result(30)
    assert [c.tinker_path for c in relisted.checkpoints] == [saved.path]
    service2.close("success").result(timeout=30)


@pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning")  # load_state: still sent
def test_bad_state_requests_fail_alone(service_client: Any, tinker_server: Server) -> None:
    import tinker

    service, base = service_client, tinker_server.model_name
    training = service.create_lora_training_client(base_model=base, rank=4).result(60)
    with pytest.raises(tinker.RequestFailedError, match="save_state name"):
        training.save_state("../escape").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError, match="no saved state"):
        service.create_training_client_from_state("tinker://nobody/weights/x").result(60)
    with pytest.raises(tinker.RequestFailedError, match="tinker://<run>/weights/<name>"):
        service.create_training_client_from_state("tinker://run/sampler_weights/x").result(60)
    path = training.save_state("s").result(timeout=60).path
    other_rank = service.create_lora_training_client(base_model=base, rank=8).result(60)
    with pytest.raises(tinker.RequestFailedError, match="LoRA"):
        other_rank.load_state(path).result(timeout=60)
    # Nothing above broke the session: the client still trains.
    assert _step(training, _data(training.get_tokenizer())) > 0

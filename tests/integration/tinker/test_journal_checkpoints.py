"""Replay checkpoints (`[tinker] journal_checkpoint_every`): a restart loads the newest
one and replays only what came after it, the stream's records before the one prior are
purged, and the client still goes on as its twin does; a checkpoint directory lost makes
the start fall back to the one before, or stop naming what is missing. Real nats-server,
the real server SIGKILLed and started again, the real SDK (test_journal.py's harness).

Marked `long` (make test-long; CI runs them after make test): about 25 s each under the
suite's load, which make test's 8 minutes did not hold; make test keeps the checkpoint
planning's unit cases (tests/unit/tinker/test_journal.py) and a restart from a
checkpoint beside the engines (test_journal_engines.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from services.stack.localdev.nats_server import NatsServer
from tests.integration.tinker.test_journal import (
    STREAM,
    Servers,
    _checkpoint_dirs,
    _last_replay,
    _poll,
    _replayed_as_recorded,
    _steps_saved,
    _stream_first_seq,
    _wait_checkpoints,
)
from tests.integration.tinker.test_retries import Raw
from tests.integration.tinker.test_state import LR, _data, _loss, _step

pytestmark = pytest.mark.long


@pytest.fixture
def servers(tiny_model: Path, tmp_path: Path, nats_server: NatsServer) -> Iterator[Servers]:
    with ExitStack() as stack:
        yield Servers(tiny_model, tmp_path, nats_server.url, stack)


def test_a_restart_from_a_checkpoint_replays_only_what_came_after_it(servers: Servers) -> None:
    """Checkpoints every 3 optim_steps: after 7 steps of A (and B's forward_backward
    pending across the checkpoint at step 6) the server is killed mid-step-8; the start
    loads the step-6 checkpoint and replays only what followed; A and B go on as their
    twins do; the stream was purged up to what the step-3 checkpoint covered."""
    import tinker
    from tinker import types

    servers.settings["journal_checkpoint_every"] = "3"
    first = servers.start()
    raw = Raw(first)  # a raw client's early future: its answer expires two checkpoints later
    raw_session = raw.session()
    lora = {"rank": 4, "seed": 11}
    create_body = {"session_id": raw_session, "model_seq_id": 0,
                   "base_model": first.model_name, "lora_config": lora}  # fmt: skip
    early = str(raw.post("create_model", create_body)["request_id"])
    raw.result(early)

    service = tinker.ServiceClient(base_url=first.base_url)
    a = service.create_lora_training_client(base_model="model", rank=4, seed=1).result(60)
    b = service.create_lora_training_client(base_model="model", rank=4, seed=2).result(60)
    data = _data(a.get_tokenizer())
    losses = [_step(a, data) for _ in range(5)]
    # B's gradients are in memory only when A's step 6 triggers the checkpoint.
    b_fb = float(b.forward_backward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"])
    losses.append(_step(a, data))
    losses.append(_step(a, data))
    fb = a.forward_backward(data, "cross_entropy").result(timeout=60)  # step 8's, then the kill
    losses.append(float(fb.metrics["loss:sum"]))
    _wait_checkpoints(servers, 2)
    dirs_before_kill = _checkpoint_dirs(servers)
    servers.kill()

    again = servers.start()
    covers, records, rerun, steps = _last_replay(servers)
    assert covers > 0  # started from a checkpoint, not from the stream's first record
    # Only what followed the step-6 checkpoint ran again: step 7 and step 8's
    # forward_backward (a step's two requests), never the six before it.
    assert steps <= 1 and rerun <= 3, (records, rerun, steps)
    # The stream no longer holds what the step-3 checkpoint covered; two directories kept.
    assert _stream_first_seq(servers) > 1
    assert len(dirs_before_kill) == 2 and int(dirs_before_kill[0]) + 1 == _stream_first_seq(servers)

    a.optim_step(types.AdamParams(learning_rate=LR)).result(timeout=120)
    losses += [_step(a, data) for _ in range(2)]
    losses.append(_loss(a, data))
    a.save_state("resumed").result(timeout=60)
    b.optim_step(types.AdamParams(learning_rate=LR)).result(timeout=120)
    b_after = _loss(b, data)

    twin = service.create_lora_training_client(base_model="model", rank=4, seed=1).result(60)
    twin_losses = [_step(twin, data) for _ in range(10)] + [_loss(twin, data)]
    twin.save_state("twin").result(timeout=60)
    assert losses == twin_losses  # bit for bit, across a checkpoint's load
    assert _steps_saved(servers.root, "resumed") == _steps_saved(servers.root, "twin") == 10
    b_twin = service.create_lora_training_client(base_model="model", rank=4, seed=2).result(60)
    assert _step(b_twin, data) == b_fb  # B's pending gradients came back with the checkpoint
    assert _loss(b_twin, data) == b_after

    # The early answer expired (two checkpoints since); its retry is still not run again.
    raw = Raw(again)
    assert _poll(raw, early)[1]["error"].startswith("this request's answer expired")
    assert raw.post("create_model", create_body)["request_id"] == early
    _replayed_as_recorded(servers)
    service.close("success").result(timeout=30)


def test_a_lost_checkpoint_falls_back_to_the_one_before_or_stops_naming_it(
    servers: Servers,
) -> None:
    """The newest checkpoint's directory deleted: the start loads the one before and
    replays from there (its records are still on the stream), to the same state. Both
    deleted, with the stream purged: the start stops with an error naming them."""
    import tinker

    servers.settings["journal_checkpoint_every"] = "2"
    first = servers.start()
    service = tinker.ServiceClient(base_url=first.base_url)
    a = service.create_lora_training_client(base_model="model", rank=4, seed=1).result(60)
    data = _data(a.get_tokenizer())
    for _ in range(4):  # checkpoints at steps 2 and 4; the purge up to step 2's
        _step(a, data)
    root = servers.root / "checkpoints" / STREAM
    _wait_checkpoints(servers, 2)
    older, newest = _checkpoint_dirs(servers)
    servers.kill()

    shutil.rmtree(root / newest)
    servers.start()
    covers, _, _, steps = _last_replay(servers)
    assert covers == int(older) and steps == 2  # steps 3 and 4 replayed
    assert "passed over checkpoint" in (servers.root / "server.log").read_text()
    after = _loss(a, data)
    twin = service.create_lora_training_client(base_model="model", rank=4, seed=1).result(60)
    for _ in range(4):
        _step(twin, data)
    assert _loss(twin, data) == after
    service.close("success").result(timeout=30)
    servers.kill()

    for d in _checkpoint_dirs(servers):
        shutil.rmtree(root / d)
    env = {**os.environ, **{f"FLYWHEEL_TINKER_{k.upper()}": v
                            for k, v in servers.settings.items()}}  # fmt: skip
    cmd = [sys.executable, "-m", "services.tinker", "--model", str(servers.model), "--port", "0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "were purged and no checkpoint stands in for them" in done.stderr
    assert "is missing" in done.stderr

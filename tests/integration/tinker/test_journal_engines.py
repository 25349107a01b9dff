"""The journal beside the engines: `[tinker] journal_stream` and `[tinker] engines` together,
on a real nats-server and a real CPU engine subprocess (LoRA on), with the real SDK.

A session trains a step, saves a sampler (its adapter goes to the engine) and samples
from it; the server is SIGKILLed and started again on the same stream and engine. Then
the old futures are answered (a sample's from its record, byte for byte), the sampler's
greedy samples are what they were (the replayed save loaded its adapter on the engine
again, under a new name), and the client trains on: its next sampler samples a model
that moved, as it would have without the restart. Twice: replaying the whole stream,
and from a replay checkpoint taken after the sampler's save (its snapshot's adapter
goes to the engine from the checkpoint's copy).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from services.stack.localdev.nats_server import NatsServer
from tests.harness.engines import EngineProcess, start_engine, stop_engine
from tests.integration.tinker.test_engines import ENGINE_MAX_RANK, PROMPTS, TEXT, _greedy, _train
from tests.integration.tinker.test_journal import (
    Servers,
    _last_replay,
    _poll,
    _replayed_as_recorded,
    _wait_checkpoints,
)
from tests.integration.tinker.test_retries import Raw

# Engines and servers started and killed, 45-100 s of a worker: scheduled first
# (tests/conftest.py), so make test does not end on this module.
pytestmark = pytest.mark.slow


@pytest.fixture
def engine(tiny_model: Path, tmp_path: Path) -> Iterator[EngineProcess]:
    lora = ["--enable-lora", "--max-lora-rank", str(ENGINE_MAX_RANK),
            "--lora-target-modules", "all"]  # fmt: skip
    proc = start_engine(tiny_model, tmp_path / "engine.log", *lora, timeout_s=120)
    yield proc
    stop_engine(proc)


@pytest.fixture
def servers(
    tiny_model: Path, tmp_path: Path, nats_server: NatsServer, engine: EngineProcess
) -> Iterator[Servers]:
    with ExitStack() as stack:
        servers = Servers(tiny_model, tmp_path, nats_server.url, stack)
        servers.settings["engines"] = json.dumps([engine.url])
        yield servers


def _sample_body(sampler: str, prompt: list[int]) -> dict[str, Any]:
    return {
        "sampling_session_id": sampler,
        "seq_id": 100,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": 6, "temperature": 1.0},  # no seed: a rerun differs
    }


# Without checkpoints (the whole log replayed) in make test-long; from a checkpoint, in
# make test (test_journal.py's restarts replay the whole log there).
@pytest.mark.parametrize("checkpoint_every", [pytest.param(0, marks=pytest.mark.long), 2])
def test_a_restart_on_the_journal_serves_the_samplers_on_the_engine_again(
    servers: Servers, engine: EngineProcess, checkpoint_every: int
) -> None:
    import tinker

    servers.settings["journal_checkpoint_every"] = str(checkpoint_every)
    first = servers.start()
    tok = first.tokens
    prompts = [tok(p) for p in PROMPTS]
    text = tok(TEXT)
    service = tinker.ServiceClient(base_url=first.base_url)
    training = service.create_lora_training_client(
        base_model=first.model_name, rank=4, seed=5
    ).result(120)
    _train(training, text, 1)
    sampler = training.save_weights_and_get_sampling_client().result(120)
    before = _greedy(sampler, prompts)
    # A sample by its future id, as a client that polls it after the restart holds it.
    raw = Raw(first)
    body = _sample_body(sampler._sampling_session_id, prompts[0])
    sample_id = str(raw.post("asample", body)["request_id"])
    sampled = _poll(raw, sample_id)
    if checkpoint_every:  # a second step: a checkpoint holding the sampler's snapshot
        _train(training, text, 1)
        _wait_checkpoints(servers, 1)
    servers.kill()

    again = servers.start()  # the same stream, port and engine
    assert (_last_replay(servers)[0] > 0) == bool(checkpoint_every)
    assert _poll(Raw(again), sample_id) == sampled  # from its record, byte for byte
    assert [s.tokens for s in _greedy(sampler, prompts)] == [s.tokens for s in before]
    # The replayed save (or the checkpoint's snapshot) loaded the adapter on the engine
    # under the new server's name.
    log = (servers.root / "server.log").read_text()
    assert log.count("on 1 engine(s) as adapter") == 2, log
    # The client trains on, and its next sampler samples the moved model.
    _train(training, text, 3)
    moved = _greedy(training.save_weights_and_get_sampling_client().result(120), prompts)
    assert [s.tokens for s in moved] != [s.tokens for s in before]
    _replayed_as_recorded(servers)
    service.close("success").result(timeout=30)

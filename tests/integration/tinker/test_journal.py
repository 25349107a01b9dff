"""Futures that survive a server restart: `[tinker] journal_stream` on a real nats-server,
the real server SIGKILLed and started again on the same stream and port.

The same SDK client goes on across the restart and trains exactly as an uninterrupted
twin does (bit for bit), with no step applied twice; a fresh client polling the old
future ids gets their answers (a finished sample from its record, a forward_backward
posted just before the kill computed once), a retried POST gets the first one's
future, and a bad request logged before the kill fails again with the same error.

Replay checkpoints: test_journal_checkpoints.py (a module of their own, so the suite's
workers run them beside these)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from services.stack.localdev.nats_server import NatsServer
from tests.harness.ports import free_port
from tests.integration.tinker.conftest import Server, serving
from tests.integration.tinker.test_retries import HEADERS, Raw
from tests.integration.tinker.test_state import LR, _data, _loss, _step

# Engines and servers started and killed, 45-100 s of a worker: scheduled first
# (tests/conftest.py), so make test does not end on this module.
pytestmark = pytest.mark.slow

STREAM = "tinker-journal-test"


class Servers:
    """Tinker servers on one journal stream, one port and one root, one at a time."""

    def __init__(self, model: Path, root: Path, nats_url: str, stack: ExitStack) -> None:
        self.model, self.root, self.stack = model, root, stack
        self.port = free_port()
        self.nats_url = nats_url
        self.settings = {"journal_stream": STREAM, "nats__url": nats_url,
                         "checkpoint_dir": str(root / "checkpoints")}  # fmt: skip
        self.process: Any = None

    def start(self) -> Server:
        url, self.process, log = self.stack.enter_context(
            serving(self.model, self.root, self.port, **self.settings)
        )
        return Server(url, self.model, self.model.name, self.process, log)

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, whatever was in flight is cut off."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def servers(tiny_model: Path, tmp_path: Path, nats_server: NatsServer) -> Iterator[Servers]:
    with ExitStack() as stack:
        yield Servers(tiny_model, tmp_path, nats_server.url, stack)


def _steps_saved(root: Path, name: str) -> int:
    """The optim_step count a save_state recorded (the model's own counter)."""
    (meta,) = (root / "state").rglob(f"{name}/meta.json")
    return int(json.loads(meta.read_text())["steps"])


def test_the_sdk_client_goes_on_across_a_restart_as_its_uninterrupted_twin(
    servers: Servers,
) -> None:
    import tinker
    from tinker import types

    first = servers.start()
    service = tinker.ServiceClient(base_url=first.base_url)
    training = service.create_lora_training_client(base_model="model", rank=4, seed=1).result(60)
    data = _data(training.get_tokenizer())
    losses = [_step(training, data) for _ in range(2)]
    # Step 3's forward_backward: its gradients exist only in the server's memory.
    fb = training.forward_backward(data, "cross_entropy").result(timeout=60)
    losses.append(float(fb.metrics["loss:sum"]))
    servers.kill()

    servers.start()  # the same stream and port: the client does not know it restarted
    training.optim_step(types.AdamParams(learning_rate=LR)).result(timeout=120)
    losses += [_step(training, data) for _ in range(2)]
    losses.append(_loss(training, data))
    training.save_state("resumed").result(timeout=60)

    twin = service.create_lora_training_client(base_model="model", rank=4, seed=1).result(60)
    twin_losses = [_step(twin, data) for _ in range(5)] + [_loss(twin, data)]
    twin.save_state("twin").result(timeout=60)
    assert losses == twin_losses  # bit for bit: the replay rebuilt step 3's gradients
    assert losses[-1] < losses[0]
    # Five optim_steps each: the replay re-ran steps 1-2 once, step 3's ran once, after.
    assert _steps_saved(servers.root, "resumed") == _steps_saved(servers.root, "twin") == 5
    _replayed_as_recorded(servers)
    service.close("success").result(timeout=30)


def _poll(raw: Raw, request_id: str, timeout: float = 120) -> tuple[str, Any]:
    """(content type, the answer: bytes or JSON) of a future, polled until it is not pending."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = raw.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if "protobuf" in r.headers["content-type"]:
            return "protobuf", r.content
        body = r.json()
        if body.get("type") != "try_again":
            return "json", body
    raise AssertionError(f"{request_id} still pending after {timeout} s")


def _post_raw(raw: Raw, path: str, body: dict[str, Any]) -> str:
    return str(raw.post(path, body)["request_id"])


def test_old_futures_are_answered_after_a_restart_and_a_retry_runs_once(
    servers: Servers,
) -> None:
    import httpx

    raw = Raw(servers.start())
    session = raw.session()
    _, model = raw.create_model(session)
    # A sample from a sampler snapshot, finished before the kill: answered from its record.
    sampler = raw.result(
        _post_raw(raw, "save_weights_for_sampler",
                  {"model_id": model, "seq_id": 1, "sampling_session_seq_id": 0})
    )["sampling_session_id"]  # fmt: skip
    prompt = raw.server.tokens("the cat")
    sample_body = {
        "sampling_session_id": sampler,
        "seq_id": 1,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": 6, "temperature": 1.0},  # no seed: a rerun would differ
    }
    sample_id = _post_raw(raw, "asample", sample_body)
    sample = _poll(raw, sample_id)
    # A bad request: logged, refused with a user error.
    bad = _post_raw(raw, "optim_step", {"model_id": model, "seq_id": 2})
    refused = _poll(raw, bad)
    assert "adam_params" in refused[1]["error"]
    # A forward_backward posted and cut off at once: logged (its id was answered), in flight.
    fb = raw.forward_backward(model, 3)
    servers.kill()

    raw = Raw(servers.start())  # a fresh client: only the ids carry over
    assert raw.forward_backward(model, 3) == fb  # the SDK's retry: the first one's future
    fb_out = raw.result(fb)
    assert _poll(raw, sample_id) == sample  # from its record, byte for byte
    assert _poll(raw, bad) == refused  # the same error again, nothing touched
    step = raw.result(raw.optim_step(model, 4))
    after = raw.loss(model, 5)

    # The twin, uninterrupted on this server, each request once.
    twin_session = raw.session()
    _, twin = raw.create_model(twin_session)
    twin_fb = raw.result(raw.forward_backward(twin, 1))
    twin_step = raw.result(raw.optim_step(twin, 2))
    assert fb_out.metrics == twin_fb.metrics
    # A backward run twice would have doubled the gradient, whose norm optim_step reports.
    assert step["metrics"] == twin_step["metrics"]
    assert after == raw.loss(twin, 3)
    # Unknown ids are still unknown: the replay made no futures of its own.
    r = httpx.post(f"{raw.server.base_url}/api/v1/retrieve_future", headers=HEADERS,
                   json={"request_id": "req-nobody-1"})  # fmt: skip
    assert r.status_code == 404
    _replayed_as_recorded(servers)


def _replayed_as_recorded(servers: Servers) -> None:
    """Every request the restart ran again answered byte for byte as it had (the server
    logs a warning for each that did not)."""
    log = (servers.root / "server.log").read_text()
    assert "records replayed" in log
    assert "otherwise than its record" not in log, log


def test_the_stream_gives_back_each_record_whole_and_skips_a_cut_off_one(
    nats_server: NatsServer,
) -> None:
    """The adapter on a real nats-server: records over max_payload go as chunks and come
    back joined, in order; a record whose last chunk never arrived (the server died while
    appending it: never acknowledged, so no client holds its future) is not replayed."""
    from proto.chunking import split
    from services.runtime.settings import NatsSettings
    from services.tinker.journal import Intake, Journal, Outcome, encode, record_id
    from services.tinker.settings import TinkerSettings
    from tests.harness.poll import run_async

    settings = TinkerSettings(
        journal_stream="unit-journal", nats=NatsSettings(url=nats_server.url, connect_attempts=3)
    )
    big = Intake("req-x-1", "/api/v1/forward_backward", bytes(range(256)) * 100)  # 25.6 kB
    answer = Outcome("req-x-1", False, {"metrics": {"loss:sum": 1.25}})
    cut = Outcome("req-x-2", False, b"\x01" * 20_000)

    async def body() -> list[Intake | Outcome]:
        journal = await Journal.open(settings)
        try:
            journal.max_payload = 4096  # as if the server's limit were small
            await journal.append(big)
            first_part = split(encode(cut), record_id(cut), 4096)[0]
            await journal._publish(first_part, f"{record_id(cut)}:c0")  # and nothing after
            await journal.append(answer)
            await journal.append(answer)  # a resend: stored once (Nats-Msg-Id)
            info = await journal.js.stream_info("unit-journal")
            chunks = len(split(encode(big), record_id(big), 4096))
            assert chunks > 1
            assert info.state.messages == chunks + 1 + 1  # big's chunks, cut's first, answer
            return await journal.read()
        finally:
            await journal.close()

    assert run_async(body()) == [big, answer]


def test_a_journal_nats_cannot_reach_stops_the_start_before_the_model_loads(
    tiny_model: Path,
) -> None:
    env = {
        **os.environ,
        "FLYWHEEL_TINKER_JOURNAL_STREAM": STREAM,
        "FLYWHEEL_TINKER_NATS__URL": f"nats://127.0.0.1:{free_port()}",  # nothing listens
        "FLYWHEEL_TINKER_NATS__CONNECT_ATTEMPTS": "1",
    }
    cmd = [sys.executable, "-m", "services.tinker", "--model", str(tiny_model), "--port", "0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "flywheel tinker: cannot connect to NATS" in done.stderr
    assert "Traceback" not in done.stderr


REPLAYED = re.compile(
    r"from the checkpoint covering sequence (\d+), (\d+) records replayed in [0-9.]+ s: "
    r"(\d+) requests run again \((\d+) optim_steps\)"
)


def _last_replay(servers: Servers) -> tuple[int, int, int, int]:
    """(the sequence the loaded checkpoint covers, records replayed, requests run
    again, optim_steps among them): the last start's Rebuilt, from its log line."""
    found = REPLAYED.findall((servers.root / "server.log").read_text())
    assert found, "no replay line in the server's log"
    covers, records, rerun, steps = (int(x) for x in found[-1])
    return covers, records, rerun, steps


def _stream_first_seq(servers: Servers) -> int:
    import nats

    from tests.harness.poll import run_async

    async def body() -> int:
        nc = await nats.connect(servers.nats_url)
        try:
            return int((await nc.jetstream().stream_info(STREAM)).state.first_seq)
        finally:
            await nc.close()

    return run_async(body())


def _wait_checkpoints(servers: Servers, n: int) -> None:
    """Until the server logs its n-th checkpoint written, recorded and purged after
    (they finish after the optim_step that made one due is answered)."""
    from tests.harness.poll import wait_for

    log = servers.root / "server.log"
    written = re.compile(r"replay checkpoint \d+ covers sequence")
    wait_for(lambda: len(written.findall(log.read_text())) >= n, 60, f"checkpoint {n}")


def _checkpoint_dirs(servers: Servers) -> list[str]:
    root = servers.root / "checkpoints" / STREAM
    return sorted(d.name for d in root.iterdir() if d.is_dir() and d.name.isdigit())

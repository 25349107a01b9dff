"""Bad input on every subject a service consumes: dead-lettered with its reason, service lives.

For each (service, subject) the real service runs as a subprocess against a
real nats-server. We publish, in order: garbage bytes, a truncated valid
message, ~900 KB of junk (under max_payload), a valid message of the wrong
type, the right message with an unknown schema major, and one with a field
of the wrong type. Each must arrive on `flywheel.<run>.dlq.<reason>` as a
DeadLetter naming the subject and keeping (a prefix of) the bytes; then a
good message must still be handled (the consumer acks it, it is not
dead-lettered, and the service's metric shows it), and the process is alive.

The rollout worker (tasks) and the trainer (batches) use the same message
loop (services/runtime/msgloop/); they are covered by the chaos suite's
runs and by tests/integration/runtime/test_msgloop.py. TODO there: the same
garbage set against their subprocesses.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from proto.codec import decode, encode
from proto.examples import EXAMPLES
from proto.messages import DeadLetter, Message, WeightsPublished, WeightsReady
from proto.streams import consumers_for, stream_name
from proto.subjects import Subjects
from services.runtime.nats_conn import connect
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer
from tests.harness import REPO

ROOT = REPO
RUN = "badin"
S = Subjects(RUN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _with(msg: Message, **changes: Any) -> bytes:
    """`msg` encoded, with raw map entries replaced (bypassing validation)."""
    body = msgpack.unpackb(encode(msg), raw=False)
    body.update(changes)
    return msgpack.packb(body, use_bin_type=True)


def bad_inputs(valid: Message, wrong: Message) -> list[tuple[str, bytes, str]]:
    """(what, bytes, expected dead-letter reason) for a subject carrying `valid`'s type."""
    data = encode(valid)
    junk = random.Random(7).randbytes(900 * 1024)
    return [
        ("garbage", b"\xc1 not msgpack at all", "malformed"),
        ("truncated", data[: len(data) // 2], "malformed"),
        ("oversized junk", b"\x92" + junk, "malformed"),
        ("wrong type", encode(wrong), "wrong_type"),
        ("schema major 2", _with(valid, schema_version="2.0"), "version"),
        ("wrong field type", _with(valid, run=["not", "a", "string"]), "schema"),
    ]


@dataclass
class Case:
    service: str
    subject: str
    durable: str
    stream: str
    valid: Message  # the shape of a message this subject carries
    wrong: Message  # a valid message of another type
    good: Callable[[Path], Message]  # a message the service must still handle
    handled_metric: tuple[str, float]  # (metric line prefix, value once handled)
    section: str = ""


def _good_ready(_: Path) -> Message:
    return WeightsReady(run=RUN, version=3, engines=())


def _good_published(tmp: Path) -> Message:
    d = tmp / "weights" / RUN / "v000001"
    d.mkdir(parents=True, exist_ok=True)
    return WeightsPublished(
        run=RUN, version=1, step=1, uri=f"file://{d}", sha256="0" * 64, size_bytes=0
    )


CASES = {
    "buffer-weights.ready": Case(
        "buffer", S.weights_ready, "buffer-ready", stream_name(RUN, "WEIGHTS"),
        EXAMPLES["WeightsReady"], EXAMPLES["SampleGroup"], _good_ready,
        ("flywheel_buffer_ready_version", 3.0),
    ),
    "buffer-samples": Case(
        "buffer", S.samples, "buffer", stream_name(RUN, "SAMPLES"),
        EXAMPLES["SampleGroup"], EXAMPLES["WeightsReady"], _good_ready,  # good: on ready
        ("flywheel_buffer_ready_version", 3.0),
    ),
    "buffer-dlq": Case(
        "buffer", S.dlq("custom"), "buffer-dlq", stream_name(RUN, "DLQ"),
        EXAMPLES["DeadLetter"], EXAMPLES["WeightsReady"], _good_ready,
        ("flywheel_buffer_ready_version", 3.0),
    ),
    "sync-weights.published": Case(
        "sync", S.weights_published, "sync", stream_name(RUN, "WEIGHTS"),
        EXAMPLES["WeightsPublished"], EXAMPLES["WeightsReady"], _good_published,
        ("flywheel_sync_published_version", 1.0),
    ),
}  # fmt: skip


def metric(url: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_messages_are_dead_lettered_and_the_service_goes_on(
    name: str, tmp_path: Path, nats_server: NatsServer, run_async: Any, eventually: Any
) -> None:
    case = CASES[name]
    port = free_port()
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        f'run = "{RUN}"\nmetrics_port = {port}\n[nats]\nurl = "{nats_server.url}"\n'
        '[task]\nsource = { type = "arithmetic", size = 10 }\n'
        "[buffer]\ngroups_per_step = 2\nsamples_per_prompt = 2\n"
        f'[sync]\nweights_root = "{tmp_path / "weights"}"\n'
    )
    log = tmp_path / f"{case.service}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{case.service}", "-c", str(run_file)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        run_async(
            _scenario(
                case, tmp_path, nats_server.url, f"http://127.0.0.1:{port}", proc, eventually
            ),
            timeout_s=90,
        )
    except BaseException:
        print(log.read_text()[-4000:])
        raise
    finally:
        proc.terminate()
        proc.wait(20)


async def _scenario(case: Case, tmp: Path, url: str, base: str, proc: Any, eventually: Any) -> None:
    nc = await connect(NatsSettings(url=url, connect_attempts=3), "badinput-test")
    try:
        js = nc.jetstream()
        await eventually(lambda: _ready(base), 30, 0.2)
        letters: list[DeadLetter] = []

        async def on_dl(msg: Any) -> None:
            letters.append(decode(msg.data, DeadLetter))

        await nc.subscribe(S.dlq_all, cb=on_dl)
        bad = bad_inputs(case.valid, case.wrong)
        for _what, data, _reason in bad:
            await js.publish(case.subject, data, timeout=10)

        def ours() -> list[DeadLetter]:
            return [d for d in letters if d.subject == case.subject and d.service == case.service]

        await eventually(lambda: len(ours()) >= len(bad), timeout_s=30, interval_s=0.1)
        got = ours()
        assert [d.reason for d in got] == [r for _, _, r in bad], [(d.reason, d.error) for d in got]
        for d, (what, data, _) in zip(got, bad, strict=True):
            assert d.payload == data[: len(d.payload)] and d.payload, what
            assert d.error, what
        # A good message is still handled, and is not dead-lettered.
        good = case.good(tmp)
        good_subject = S.weights_ready if isinstance(good, WeightsReady) else case.subject
        await js.publish(good_subject, encode(good), timeout=10)
        metric_name, want = case.handled_metric
        await eventually(lambda: metric(f"{base}/metrics", metric_name) == want, 30, 0.1)

        async def settled() -> bool:  # the metric moves before the ack reaches the server
            info = await js.consumer_info(case.stream, case.durable)
            return info.num_ack_pending == 0 and info.num_pending == 0

        await eventually(settled, 10, 0.1)
        assert proc.poll() is None
        assert len(ours()) == len(bad)
    finally:
        await nc.close()


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


assert set(consumers_for(RUN)) >= {"buffer", "buffer-ready", "buffer-dlq", "sync"}

"""A poison message that reaches max_deliver while its service is down is still dead-lettered.

nats-server announces a message it stopped redelivering once, on a core
subject. The service that hangs on it is killed (SIGKILL) right after the
last delivery; the announcement comes while it is down (here an operator's
pull request sets it off, as the server does on the next pull after the
ack wait). The run's ADVISORIES stream keeps it, and the service, started
again, dead-letters the message from it. Real nats-server, real processes.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from proto.codec import decode, encode
from proto.examples import EXAMPLES
from proto.messages import DeadLetter
from proto.streams import stream_name, streams_for
from proto.subjects import Subjects
from services.runtime.msgloop import REASON_HEADER
from services.runtime.nats_conn import connect, ensure_consumer, ensure_streams
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer
from tests.harness import REPO
from tests.integration.runtime.poison_worker import poison_consumer

WORKER = "tests.integration.runtime.poison_worker"


class Worker:
    """The service as a subprocess; `lines` what it printed so far."""

    def __init__(self, url: str, run: str, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER, url, run],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    async def until(self, line: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while line not in self.lines():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {line!r}: " + self.log.read_text()[-3000:]
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def _count(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


def test_the_poison_message_is_dead_lettered_although_its_service_was_down(
    nats_server: NatsServer, tmp_path: Path, run_async: Any
) -> None:
    run = "poison-down"
    spec = poison_consumer(run)
    dlq, advisories = stream_name(run, "DLQ"), stream_name(run, "ADVISORIES")
    data = encode(EXAMPLES["SampleGroup"])
    workers: list[Worker] = []

    async def body() -> None:
        nc = await connect(NatsSettings(url=nats_server.url, connect_attempts=3), "poison-test")
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for(run))
            await ensure_consumer(js, spec)
            await js.publish(Subjects(run).samples, data)

            first = Worker(nats_server.url, run, tmp_path / "first.log")
            workers.append(first)
            await first.until("delivered 2")  # the last delivery it may have
            first.proc.kill()  # down before its ack wait ends: it never hears the notice
            first.proc.wait(10)

            # The server gives up on the next pull after the ack wait: an operator's.
            await asyncio.sleep(spec.ack_wait_s + 0.5)
            operator = await js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
            deadline = time.monotonic() + 30
            while await _count(js, advisories) == 0:
                assert time.monotonic() < deadline, "no max-deliveries notice was stored"
                try:
                    got = await operator.fetch(1, timeout=0.5)
                except TimeoutError:
                    got = []
                assert got == [], "redelivered past max_deliver"
            await operator.unsubscribe()
            assert await _count(js, dlq) == 0  # nobody has dead-lettered it yet

            second = Worker(nats_server.url, run, tmp_path / "second.log")
            workers.append(second)
            deadline = time.monotonic() + 60
            while await _count(js, dlq) == 0:
                assert second.proc.poll() is None, second.log.read_text()[-3000:]
                assert time.monotonic() < deadline, second.log.read_text()[-3000:]
                await asyncio.sleep(0.1)
            assert not any(ln.startswith("delivered") for ln in second.lines())
            stored = await js.get_msg(dlq, 1)
            assert (stored.headers or {})[REASON_HEADER] == "max_deliver"
            letter = decode(stored.data or b"", DeadLetter)
            assert letter.payload == data and letter.delivered == 2
            assert letter.subject == Subjects(run).samples
            deadline = time.monotonic() + 10  # the notice is acked (a work queue: removed)
            while await _count(js, advisories):
                assert time.monotonic() < deadline, "the handled notice was not acked"
                await asyncio.sleep(0.1)
        finally:
            await nc.close()

    try:
        run_async(body(), timeout_s=180)
    finally:
        for w in workers:
            w.stop()

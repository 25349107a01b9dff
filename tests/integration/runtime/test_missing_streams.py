"""A stream, KV bucket or consumer deleted under a running service stops it, naming it.

JetStream answers a publish to a deleted stream, a fetch from a deleted
consumer and a write to a deleted bucket with "no responders", as it does
while it restarts; the services used to retry those forever (the buffer with
a warning every round). Now the server is asked, and what it confirms gone
stops the service with `JetStreamMissing`: exit status 4, one line that
names it, and `flywheel up` stops the run (a restart would make it again,
empty). A real nats-server throughout; the last tests run the real buffer
and sync as subprocesses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proto.codec import encode
from proto.messages import SampleGroup, WeightsReady
from proto.streams import consumers_for, kv_bucket, stream_name, streams_for
from proto.subjects import Subjects
from services.runtime.errors import EXIT_MISSING, JetStreamMissing
from services.runtime.msgloop import Delivery, MessageLoop
from services.runtime.nats_conn import connect, ensure_consumer, ensure_streams
from services.runtime.publish import publish
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer
from services.stack.supervisor import FINAL
from tests.harness import REPO
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file


async def _js(settings: NatsSettings) -> Any:
    return await connect(settings, "missing-test")


def test_a_publish_to_a_deleted_stream_stops_naming_it(nats_settings_module, run_async) -> None:
    run = "gone-pub"

    async def body() -> None:
        nc = await _js(nats_settings_module)
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for(run))
            ready = WeightsReady(run=run, version=1, engines=())
            await publish(js, Subjects(run).weights_ready, ready, 1 << 20)  # the control
            await js.delete_stream(stream_name(run, "WEIGHTS"))
            started = time.monotonic()
            with pytest.raises(JetStreamMissing) as err:
                await publish(js, Subjects(run).weights_ready, ready, 1 << 20)
            # Not after publish's 30 s of retries: at the first "no responders".
            assert time.monotonic() - started < 10
            assert err.value.kind == "stream" and err.value.name == f"FLYWHEEL_{run}_WEIGHTS"
            assert "weights.ready" in str(err.value)
        finally:
            await nc.close()

    run_async(body())


def _loop(js: Any, spec: Any, run: str) -> MessageLoop[SampleGroup]:
    async def handle(group: SampleGroup, d: Delivery) -> None:
        return None

    return MessageLoop(
        js, spec, SampleGroup, handle, run=run, service="buffer",
        registry=CollectorRegistry(), max_payload=1 << 20, fetch_timeout_s=0.2,
    )  # fmt: skip


@pytest.mark.parametrize("delete", ["stream", "consumer"])
def test_a_message_loop_whose_stream_or_consumer_is_deleted_ends_naming_it(
    delete: str, nats_settings_module, run_async
) -> None:
    run = f"gone-loop-{delete}"

    async def body() -> None:
        nc = await _js(nats_settings_module)
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for(run))
            spec = consumers_for(run)["buffer"]
            await ensure_consumer(js, spec)
            task = asyncio.create_task(_loop(js, spec, run).run(asyncio.Event()))
            await asyncio.sleep(0.5)
            assert not task.done()
            if delete == "stream":
                await js.delete_stream(spec.stream)
            else:
                await js.delete_consumer(spec.stream, spec.durable)
            with pytest.raises(JetStreamMissing) as err:
                await asyncio.wait_for(task, 15)
            assert err.value.kind == delete
            assert spec.stream in err.value.name
        finally:
            await nc.close()

    run_async(body())


def test_a_handler_whose_publish_meets_a_deleted_stream_ends_the_loop(
    nats_settings_module, run_async
) -> None:
    """Not dead-lettered as a handler bug: the message goes back, the loop ends."""
    run = "gone-handler"

    async def body() -> None:
        nc = await _js(nats_settings_module)
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for(run))
            await js.delete_stream(stream_name(run, "BATCHES"))
            spec = dataclasses.replace(consumers_for(run)["buffer"], max_deliver=2)
            await ensure_consumer(js, spec)

            async def handle(group: SampleGroup, d: Delivery) -> None:
                await publish(js, Subjects(run).batches, group, 1 << 20)

            loop = _loop(js, spec, run)
            loop.handler = handle
            from proto.examples import EXAMPLES

            await js.publish(Subjects(run).samples, encode(EXAMPLES["SampleGroup"]))
            with pytest.raises(JetStreamMissing, match=f"FLYWHEEL_{run}_BATCHES"):
                await asyncio.wait_for(loop.run(asyncio.Event()), 20)
            info = await js.stream_info(stream_name(run, "DLQ"))
            assert info.state.messages == 0  # not dead-lettered
        finally:
            await nc.close()

    run_async(body())


# ── the services, as subprocesses ──────────────────────────────────────────────
def _start(service: str, run: str, url: str, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = tmp / "run.toml"
    cfg.write_text(
        run_file(
            run,
            # The stop drains the connection first; a loop that ended leaves fetched
            # messages nobody handles, so the drain waits out its timeout (30 s by default).
            nats={"url": url, "connect_attempts": 3, "drain_timeout_s": 2.0},
            task={"source": {"type": "arithmetic", "size": 20}},
            buffer={"groups_per_step": 2, "samples_per_prompt": 2, "max_staleness": 0},
            sync={"weights_root": str(tmp / "weights")},
        )
    )
    log = tmp / f"{service}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{service}", "-c", str(cfg)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return proc, log


async def _started(js: Any, service: str, run: str) -> bool:
    """The service has made its streams (the buffer: and published its first tasks)."""
    from nats.js.errors import NotFoundError

    try:
        if service == "sync":
            return bool(await js.consumer_info(stream_name(run, "WEIGHTS"), "sync"))
        return bool((await js.stream_info(stream_name(run, "TASKS"))).state.messages)
    except NotFoundError:
        return False  # not made yet


CASES = {
    # what is deleted, the service, and what then makes it touch it
    "buffer-kv": ("buffer", "KV bucket", lambda run: kv_bucket(run, "buffer"), "ready"),
    "buffer-tasks": ("buffer", "stream", lambda run: stream_name(run, "TASKS"), "ready"),
    "sync-weights": ("sync", "stream", lambda run: stream_name(run, "WEIGHTS"), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_service_stops_with_exit_4_and_one_line_naming_it(
    case: str, tmp_path: Path, nats_server: NatsServer, run_async: Any
) -> None:
    service, kind, name_of, poke = CASES[case]
    run = f"gone-{case}"
    name = name_of(run)
    proc, log = _start(service, run, nats_server.url, tmp_path)
    settings = NatsSettings(url=nats_server.url, connect_attempts=3)

    async def delete_it() -> None:
        nc = await _js(settings)
        try:
            js = nc.jetstream()
            deadline = time.monotonic() + 60
            while not await _started(js, service, run):  # its streams (buffer: tasks too)
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                await asyncio.sleep(0.2)
            if kind == "KV bucket":
                await js.delete_key_value(name)
            else:
                await js.delete_stream(name)
            if poke == "ready":  # admission opens: the buffer dispatches and writes its state
                ready = WeightsReady(run=run, version=1, engines=())
                await js.publish(Subjects(run).weights_ready, encode(ready))
        finally:
            await nc.close()

    try:
        run_async(delete_it(), timeout_s=90)
        code = wait_for(lambda: proc.poll() is not None and (proc.returncode,), 60, "exit")[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert code == EXIT_MISSING and code in FINAL, text[-3000:]
    last = [ln for ln in text.splitlines() if ln.startswith(f"flywheel {service}:")]
    assert len(last) == 1, text[-3000:]
    assert f"JetStream {kind} {name} does not exist" in last[0]
    assert "Traceback" not in text, text[-3000:]
    # Bounded: no warning loop before it stopped.
    assert text.count("retrying") < 20, text[-3000:]

"""The message loop against a real nats-server: round trips, dedupe, dead letters, retries."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from proto.codec import decode, encode, message_id
from proto.examples import EXAMPLES
from proto.messages import DeadLetter, Message, SampleGroup
from proto.streams import ConsumerSpec, StreamSpec, consumers_for, streams_for
from proto.subjects import Subjects
from services.runtime.errors import PermanentError, RetryableError
from services.runtime.msgloop import ERROR_HEADER, REASON_HEADER, Delivery, MessageLoop
from services.runtime.nats_conn import connect, ensure_consumer, ensure_streams

MAX_PAYLOAD = 1024 * 1024


async def with_js(settings, body: Callable[[Any, Any], Awaitable[None]]) -> None:
    nc = await connect(settings, "test")
    try:
        await body(nc, nc.jetstream())
    finally:
        await nc.close()


async def run_loop_until(loop: MessageLoop, done: Callable[[], bool], timeout_s: float = 15.0):
    """Run `loop` until `done()` holds (polled), then stop it and wait for it to finish."""
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        async with asyncio.timeout(timeout_s):
            while not done():
                if task.done():
                    task.result()  # surface a crash of the loop itself
                    raise AssertionError("message loop exited early")
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def dead_letters(js, run: str, count: int) -> list[Any]:
    """The first `count` messages of the run's DLQ stream, via an ephemeral pull consumer."""
    sub = await js.pull_subscribe(Subjects(run).dlq_all, durable=None, stream=f"FLYWHEEL_{run}_DLQ")
    got: list[Any] = []
    async with asyncio.timeout(10):
        while len(got) < count:
            try:
                got += await sub.fetch(count - len(got), timeout=1)
            except TimeoutError:
                continue
    for m in got:
        await m.ack()
    await sub.unsubscribe()
    return got


def sample_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_every_message_type_round_trips_through_a_durable_pull_consumer(
    nats_settings_module, run_async
):
    run = "wire"
    stream = StreamSpec("FLYWHEEL_wire_TEST", (f"flywheel.{run}.wire.*",))

    async def body(nc, js):
        await ensure_streams(js, [stream])
        received: dict[str, Message] = {}
        loops = []
        for name, msg in EXAMPLES.items():
            subject = f"flywheel.{run}.wire.{name}"
            spec = ConsumerSpec(f"c-{name}", stream.name, subject, ack_wait_s=5)
            await ensure_consumer(js, spec)
            # Ids are unique per message type (a PromptTask and its SampleGroup
            # share one); real streams hold one type each, this test stream all.
            headers = {"Nats-Msg-Id": f"{name}:{mid}"} if (mid := message_id(msg)) else None
            ack = await js.publish(subject, encode(msg), headers=headers)
            assert ack.stream == stream.name

            async def handle(m: Message, d: Delivery, name: str = name) -> None:
                received[name] = m

            loops.append(
                MessageLoop(
                    js,
                    spec,
                    type(msg),
                    handle,
                    run=run,
                    service="t",
                    registry=CollectorRegistry(),
                    max_payload=MAX_PAYLOAD,
                    fetch_timeout_s=0.2,
                )
            )
        stop = asyncio.Event()
        tasks = [asyncio.create_task(lp.run(stop)) for lp in loops]
        async with asyncio.timeout(15):
            while len(received) < len(EXAMPLES):
                for t in tasks:
                    if t.done():
                        t.result()
                await asyncio.sleep(0.02)
        stop.set()
        await asyncio.gather(*tasks)
        assert received == EXAMPLES
        # every message was acked: nothing pending on any consumer
        for lp in loops:
            info = await js.consumer_info(stream.name, lp.consumer.durable)
            assert info.num_ack_pending == 0 and info.num_pending == 0

    run_async(with_js(nats_settings_module, body))


def test_same_msg_id_is_stored_once(nats_settings_module, run_async):
    run = "dedupe"

    async def body(nc, js):
        await ensure_streams(js, streams_for(run))
        group = EXAMPLES["SampleGroup"]
        data, mid = encode(group), message_id(group)
        first = await js.publish(Subjects(run).samples, data, headers={"Nats-Msg-Id": mid})
        second = await js.publish(Subjects(run).samples, data, headers={"Nats-Msg-Id": mid})
        assert not first.duplicate and second.duplicate
        assert second.seq == first.seq
        info = await js.stream_info(f"FLYWHEEL_{run}_SAMPLES")
        assert info.state.messages == 1

    run_async(with_js(nats_settings_module, body))


def test_bad_messages_are_dead_lettered_and_the_loop_goes_on(nats_settings_module, run_async):
    run = "dlq"
    subjects = Subjects(run)
    garbage = b"\xc1garbage"
    wrong_type = encode(EXAMPLES["WeightsReady"])

    async def body(nc, js):
        await ensure_streams(js, streams_for(run))
        spec = consumers_for(run)["buffer"]
        await ensure_consumer(js, spec)
        registry = CollectorRegistry()
        handled: list[str] = []

        async def handle(group: SampleGroup, d: Delivery) -> None:
            if group.task_name == "boom":
                raise KeyError("a bug in the handler")
            if group.task_name == "stale":
                raise PermanentError("sample older than the staleness bound", reason="stale")
            handled.append(group.group_id)

        good = EXAMPLES["SampleGroup"]
        bug = good.model_copy(update={"group_id": "bug", "task_name": "boom"})
        old = good.model_copy(update={"group_id": "old", "task_name": "stale"})
        for data in (garbage, wrong_type, encode(bug), encode(old), encode(good)):
            await js.publish(subjects.samples, data)

        loop = MessageLoop(
            js,
            spec,
            SampleGroup,
            handle,
            run=run,
            service="buffer",
            registry=registry,
            max_payload=MAX_PAYLOAD,
            fetch_timeout_s=0.2,
        )
        await run_loop_until(loop, lambda: handled == [good.group_id])

        letters = await dead_letters(js, run, 4)
        by_reason = {m.headers[REASON_HEADER]: m for m in letters}
        assert set(by_reason) == {"malformed", "wrong_type", "handler_error", "stale"}
        for reason, m in by_reason.items():
            assert m.subject == subjects.dlq(reason)
            dl = decode(m.data, DeadLetter)
            assert dl.reason == reason and dl.run == run and dl.service == "buffer"
            assert dl.subject == subjects.samples and dl.delivered == 1
            assert m.headers[ERROR_HEADER] and "\n" not in m.headers[ERROR_HEADER]
        assert decode(by_reason["malformed"].data, DeadLetter).payload == garbage
        assert decode(by_reason["wrong_type"].data, DeadLetter).payload == wrong_type
        assert decode(by_reason["wrong_type"].data, DeadLetter).message_type == "WeightsReady"
        assert "KeyError" in by_reason["handler_error"].headers[ERROR_HEADER]

        labels = {"service": "buffer", "subject": subjects.samples}
        assert sample_value(registry, "flywheel_messages_handled_total", **labels) == 1
        for reason in ("malformed", "wrong_type", "handler_error", "stale"):
            assert (
                sample_value(
                    registry, "flywheel_messages_dead_lettered_total", **labels, reason=reason
                )
                == 1
            )
        info = await js.consumer_info(spec.stream, spec.durable)
        assert info.num_ack_pending == 0 and info.num_pending == 0

    run_async(with_js(nats_settings_module, body))


def test_retryable_error_is_redelivered_then_succeeds(nats_settings_module, run_async):
    run = "retry"

    async def body(nc, js):
        await ensure_streams(js, streams_for(run))
        spec = consumers_for(run)["buffer"]
        await ensure_consumer(js, spec)
        registry = CollectorRegistry()
        deliveries: list[int] = []
        done: list[str] = []

        async def handle(group: SampleGroup, d: Delivery) -> None:
            deliveries.append(d.delivered)
            if d.delivered < 3:
                raise RetryableError("engine busy", delay_s=0.05)
            done.append(group.group_id)

        await js.publish(Subjects(run).samples, encode(EXAMPLES["SampleGroup"]))
        loop = MessageLoop(
            js,
            spec,
            SampleGroup,
            handle,
            run=run,
            service="buffer",
            registry=registry,
            max_payload=MAX_PAYLOAD,
            fetch_timeout_s=0.2,
        )
        await run_loop_until(loop, lambda: bool(done))
        assert deliveries == [1, 2, 3]
        labels = {"service": "buffer", "subject": Subjects(run).samples}
        assert (
            sample_value(registry, "flywheel_messages_failed_total", **labels, reason="retryable")
            == 2
        )
        assert sample_value(registry, "flywheel_messages_handled_total", **labels) == 1
        assert sample_value(registry, "flywheel_handler_seconds_count", **labels) == 3

    run_async(with_js(nats_settings_module, body))


def test_poison_message_is_dead_lettered_at_max_deliver(nats_settings_module, run_async):
    run = "poison"

    async def body(nc, js):
        await ensure_streams(js, streams_for(run))
        spec = dataclasses.replace(consumers_for(run)["buffer"], max_deliver=3)
        await ensure_consumer(js, spec)
        deliveries: list[int] = []

        async def handle(group: SampleGroup, d: Delivery) -> None:
            deliveries.append(d.delivered)
            raise RetryableError("always failing", delay_s=0.02)

        await js.publish(Subjects(run).samples, encode(EXAMPLES["SampleGroup"]))
        loop = MessageLoop(
            js,
            spec,
            SampleGroup,
            handle,
            run=run,
            service="buffer",
            registry=CollectorRegistry(),
            max_payload=MAX_PAYLOAD,
            fetch_timeout_s=0.2,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        letters = await dead_letters(js, run, 1)
        stop.set()
        await task
        assert deliveries == [1, 2, 3]
        (m,) = letters
        assert m.headers[REASON_HEADER] == "max_deliver"
        dl = decode(m.data, DeadLetter)
        assert dl.delivered == 3 and "always failing" in dl.error

    run_async(with_js(nats_settings_module, body))


def test_heartbeats_keep_a_long_handler_from_being_redelivered(nats_settings_module, run_async):
    """With ack_wait 1 s, a 2 s handler is redelivered unless in-progress acks are sent."""

    def scenario(run: str, heartbeat_s: float) -> list[int]:
        deliveries: list[int] = []
        finished: list[int] = []

        async def body(nc, js):
            await ensure_streams(js, streams_for(run))
            spec = dataclasses.replace(consumers_for(run)["buffer"], ack_wait_s=1.0)
            await ensure_consumer(js, spec)

            async def handle(group: SampleGroup, d: Delivery) -> None:
                deliveries.append(d.delivered)
                await asyncio.sleep(2.0)
                finished.append(d.delivered)

            await js.publish(Subjects(run).samples, encode(EXAMPLES["SampleGroup"]))
            loop = MessageLoop(
                js,
                spec,
                SampleGroup,
                handle,
                run=run,
                service="buffer",
                registry=CollectorRegistry(),
                max_payload=MAX_PAYLOAD,
                concurrency=2,
                heartbeat_s=heartbeat_s,
                fetch_timeout_s=0.2,
            )
            await run_loop_until(loop, lambda: len(finished) >= 1)

        run_async(with_js(nats_settings_module, body))
        return deliveries

    assert scenario("hb-on", heartbeat_s=0.2) == [1]
    assert len(scenario("hb-off", heartbeat_s=0)) >= 2  # the control: it does get redelivered


def test_message_the_server_gives_up_on_is_dead_lettered(nats_settings_module, run_async):
    """A handler hangs past ack_wait each time: the max-deliveries advisory dead-letters it."""
    run = "hang"

    async def body(nc, js):
        await ensure_streams(js, streams_for(run))
        spec = dataclasses.replace(consumers_for(run)["buffer"], ack_wait_s=0.3, max_deliver=2)
        await ensure_consumer(js, spec)
        release = asyncio.Event()
        deliveries: list[int] = []

        async def hang(group: SampleGroup, d: Delivery) -> None:
            deliveries.append(d.delivered)
            await release.wait()  # never acks in time, like a hung or crashed worker

        data = encode(EXAMPLES["SampleGroup"])
        await js.publish(Subjects(run).samples, data)
        registry = CollectorRegistry()
        loop = MessageLoop(
            js,
            spec,
            SampleGroup,
            hang,
            run=run,
            service="buffer",
            registry=registry,
            max_payload=MAX_PAYLOAD,
            concurrency=4,
            heartbeat_s=0,
            fetch_timeout_s=0.2,
            nc=nc,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        try:
            (m,) = await dead_letters(js, run, 1)
        finally:
            release.set()
            stop.set()
            await task
        assert deliveries == [1, 2]
        assert m.headers[REASON_HEADER] == "max_deliver"
        dl = decode(m.data, DeadLetter)
        assert dl.payload == data and dl.delivered == 2 and dl.subject == Subjects(run).samples
        labels = {"service": "buffer", "subject": Subjects(run).samples, "reason": "max_deliver"}
        assert sample_value(registry, "flywheel_messages_dead_lettered_total", **labels) == 1

    run_async(with_js(nats_settings_module, body))

"""The trainer's batch reader against a real nats-server: a batch carrying a NaN logprob
is dead-lettered naming the field, and the next batch of the step is the one trained."""

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from proto.codec import decode, encode
from proto.examples import EXAMPLES
from proto.messages import DeadLetter, TrainBatch, pack_f32
from proto.streams import streams_for
from proto.subjects import Subjects
from services.runtime.nats_conn import connect, ensure_streams
from services.trainer.batches import BatchReader

RUN = "nanrun"


def _batches() -> tuple[bytes, TrainBatch]:
    good = EXAMPLES["TrainBatch"].model_copy(update={"run": RUN, "step": 0})
    group = good.groups[0]
    sample = group.samples[0]
    n = sample.num_response_tokens
    poisoned = sample.model_copy(update={"logprobs": pack_f32([float("nan")] * n)})
    bad = good.model_copy(
        update={"groups": (group.model_copy(update={"samples": (sample, poisoned)}),)}
    )
    return encode(bad), good  # model_copy skips validation: what a faulty producer sends


def test_non_finite_batch_is_dead_lettered_and_the_next_one_read(nats_settings_module, run_async):
    bad, good = _batches()

    async def body() -> None:
        nc = await connect(nats_settings_module, "test")
        js = nc.jetstream()
        try:
            await ensure_streams(js, streams_for(RUN))
            subjects = Subjects(RUN)
            await js.publish(subjects.batches, bad)
            await js.publish(subjects.batches, encode(good))
            ctx = SimpleNamespace(js=js, max_payload=1024 * 1024, registry=CollectorRegistry())
            reader = BatchReader(ctx, RUN, start_seq=1)  # type: ignore[arg-type]
            await reader.open()
            got = await asyncio.wait_for(reader.next(0, asyncio.Event()), 10)
            await reader.close()
            assert got is not None and got[0] == good and got[1] == 2
            sub = await js.pull_subscribe(subjects.dlq_all, durable=None)
            msgs = await sub.fetch(1, timeout=5)
            letter = decode(msgs[0].data, DeadLetter)
            assert letter.reason == "schema" and letter.service == "trainer"
            assert "groups.0.samples.1.logprobs" in letter.error and letter.payload == bad
            await sub.unsubscribe()
        finally:
            await nc.close()

    run_async(body())


def _consumer_server(cluster, stream: str) -> str:
    """The server holding `stream`'s one consumer (the reader's ephemeral one), from /jsz."""
    for node in cluster.nodes:
        report = cluster.jsz(node, "streams=true&consumers=true")
        for account in report.get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                for consumer in (
                    detail.get("consumer_detail") or [] if detail["name"] == stream else []
                ):
                    return str(consumer["cluster"]["leader"])
    raise AssertionError(f"no consumer on {stream}")


@pytest.mark.slow  # a 3-server cluster of its own, one server killed
def test_the_reader_goes_on_when_the_server_of_its_consumer_is_killed(tmp_path, run_async):
    """An ephemeral consumer has one replica: killed with its server (found by the
    cluster chaos run, where the trainer then waited for ever)."""
    from services.runtime.publish import publish
    from services.runtime.settings import NatsSettings
    from services.stack.localdev.nats_cluster import NatsCluster

    batch = EXAMPLES["TrainBatch"].model_copy(update={"run": RUN})

    def step(s: int) -> TrainBatch:  # its own id: JetStream drops a repeated one
        return batch.model_copy(update={"step": s, "batch_id": f"{RUN}:step{s}"})

    with NatsCluster(3, store_root=tmp_path) as cluster:

        async def body() -> None:
            nc = await connect(NatsSettings(url=cluster.url, connect_attempts=3), "test")
            js = nc.jetstream()
            try:
                await ensure_streams(js, streams_for(RUN), replicas=3)
                subjects = Subjects(RUN)
                ctx = SimpleNamespace(js=js, max_payload=1024 * 1024, registry=CollectorRegistry())
                reader = BatchReader(ctx, RUN, start_seq=1)  # type: ignore[arg-type]
                await reader.open()
                await publish(js, subjects.batches, step(0), 1 << 20)
                got = await asyncio.wait_for(reader.next(0, asyncio.Event()), 10)
                assert got is not None and got[0].step == 0
                holder = _consumer_server(cluster, f"FLYWHEEL_{RUN}_BATCHES")
                await asyncio.to_thread(cluster.kill, holder)
                await publish(js, subjects.batches, step(1), 1 << 20)
                got = await asyncio.wait_for(reader.next(1, asyncio.Event()), 60)
                assert got is not None and got[0].step == 1 and got[1] == 2
                await reader.close()
            finally:
                await nc.close()

        run_async(body(), timeout_s=120)

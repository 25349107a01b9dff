"""The trainer's batch reader against a real nats-server: a batch carrying a NaN logprob
is dead-lettered naming the field, and the next batch of the step is the one trained."""

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from proto.codec import decode, encode
from proto.examples import EXAMPLES
from proto.messages import DeadLetter, TrainBatch, pack_f32
from proto.streams import streams_for
from proto.subjects import Subjects
from services.common.nats_conn import connect, ensure_streams
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

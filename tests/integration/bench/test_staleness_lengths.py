"""bench/staleness_lengths.py reads a stopped run's store: a real nats-server, the run's
real streams (proto/streams.py), a group published in chunks, a stale dead letter.

The analysis is unit-tested (tests/unit/replay/test_lengths.py); this checks the
reading: that the bench finds the run in a store by its streams alone, opens the
store with a nats-server of its own once the run's has stopped, puts chunked
messages back together, and counts what the streams hold.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.staleness_lengths import main
from proto.codec import encode
from proto.messages import (
    DeadLetter,
    FinishReason,
    Sample,
    SampleGroup,
    TrainBatch,
    pack_f32,
    pack_i32,
    pack_u8,
)
from proto.streams import streams_for
from proto.subjects import Subjects
from services.runtime.publish import publish
from services.stack.localdev.nats_server import NatsServer

RUN = "lens"
S = Subjects(RUN)


def group(gid: str, *lengths: int) -> SampleGroup:
    samples = tuple(
        Sample(sample_id=f"{gid}:s{i}", group_id=gid, task_id=f"{gid}-t", index=i,
               prompt_ids=pack_i32([1]), response_ids=pack_i32([7] * n),
               logprobs=pack_f32([-0.5] * n), loss_mask=pack_u8([1] * n), reward=float(i),
               finish_reason=FinishReason.STOP, weight_version=0, weight_version_last=0,
               engine_id="engine-0")
        for i, n in enumerate(lengths)
    )  # fmt: skip
    return SampleGroup(run=RUN, group_id=gid, task_id=f"{gid}-t", env="arith",
                       worker_id="rollout-0", samples=samples)  # fmt: skip


async def record(url: str) -> None:
    """A run's streams as the services leave them: groups (one past max_payload, so
    chunked), one batch, one group dropped as stale."""
    import nats

    from services.runtime.nats_streams import ensure_streams

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, streams_for(RUN))
        short, long_ = group("g-short", 3, 5), group("g-long", 40, 60)
        huge = group("g-huge", 9, 300_000)  # ~3.6 MB: chunked past the 1 MiB max_payload
        for g in (short, long_, huge):
            await publish(js, S.samples, g, 1 << 20)
        await publish(js, S.batches, TrainBatch(run=RUN, batch_id=f"{RUN}:step0", step=0,
                                                groups=(short, huge)), 1 << 20)  # fmt: skip
        dead = DeadLetter(run=RUN, reason="stale", subject=S.samples, message_type="SampleGroup",
                          error="group g-long (version 0) dropped at step 1: stale",
                          payload=encode(long_), service="buffer")  # fmt: skip
        await publish(js, S.dlq("stale"), dead, 1 << 20)
    finally:
        await nc.close()


def test_a_stopped_runs_store_is_read_and_tabled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with NatsServer(store_dir=run_dir / "nats") as server:
        asyncio.run(record(server.url))
    # stopped: the bench opens the store with a nats-server of its own
    assert main([str(run_dir)]) == 0
    rows = {
        tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(f"| {RUN} ")
    }
    assert "| 6 (100.0%) |" in rows[(f"{RUN} (run)", "generated")]
    assert "| 2 (33.3%) | 50.0 | 40 | 60 |" in rows[(f"{RUN} (run)", "stale")]
    assert "| 4 (66.7%) |" in rows[(f"{RUN} (run)", "trained")]
    assert "p = " in rows[(f"{RUN} (run)", "KS trained vs generated")]

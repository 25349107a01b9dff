"""A reward check that hangs past its limit: a dead letter with its reason, never a baseline.

Real parts end to end: a real nats-server, the real buffer service (a
subprocess) dispatching arithmetic tasks, the real rollout service (in this
process, as test_judge.py runs it) generating 6 completions per task at
temperature 1 on the CPU engine (a tiny model), and its verifier pool's real
sandbox processes scoring them with a custom reward named in the run file
that hangs on about half of all completions (`bad_verifiers.hangs_on_half`).

What must hold: each completion whose check hung is published unscored
(reward 0 with its `verifier_error`) and dead-lettered alone as
`verifier_timeout` with its sample id; the train batch the buffer publishes
holds the scored samples only; and the trainer's per-token advantages of
that batch (`to_tensor_batch`, `Trainer._rl_rows`) are GRPO's over the
group's scored members alone.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

from prometheus_client import CollectorRegistry

from proto.codec import decode
from proto.messages import DeadLetter, SampleGroup, TrainBatch
from proto.streams import stream_name, streams_for
from proto.subjects import Subjects
from services.rollout.app import body as rollout_body
from services.rollout.settings import RolloutSettings
from services.runtime.lifecycle import run_service
from services.runtime.nats_conn import connect, ensure_streams
from services.runtime.settings import NatsSettings, load_settings
from services.stack.localdev.nats_server import NatsServer
from services.trainer.settings import LossConfig
from tests.harness.engines import EngineStates, serving_engine
from tests.harness.runfile import run_file
from tests.harness.streams import read_stream_async
from tests.integration.buffer.test_buffer_service import start_buffer
from tests.unit.buffer.test_failures_never_rewards import reference, trained_advantages

RUN = "failing"
S = Subjects(RUN)
REWARD = "tests.integration.rollout.bad_verifiers:hangs_on_half"
LIMIT_S = 1.5  # the verifier pool's time limit (a quick check must pass it on a loaded box)


def config_for(tmp_path: Path, url: str) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(
        run_file(
            RUN,
            nats={"url": url},
            rollout={"concurrency": 2, "heartbeat_s": 0.3, "verifier_timeout_s": LIMIT_S},
            engine={"num_threads": 1},
            buffer={
                "groups_per_step": 1,
                "max_staleness": 2,  # no trainer here: room for three batches at version 0
                "samples_per_prompt": 6,
                "temperature": 1.0,
                "max_new_tokens": 6,
                "min_scored_per_group": 2,
                "dispatch_interval_s": 0.05,
            },
        )
        + f'\n[task]\nsource = {{ type = "arithmetic", size = 50 }}\nreward = "{REWARD}"\n'
    )
    return config


def test_a_hung_check_is_a_dead_letter_and_the_group_trains_on_its_scored_members(
    tmp_path: Path, tiny_model: Path
) -> None:
    engines = EngineStates(tiny_model)
    try:
        with NatsServer() as nats:
            ran = run(nats.url, tmp_path, tiny_model, engines)
            groups, dead, batch = asyncio.run(asyncio.wait_for(ran, 240))
    finally:
        engines.close()

    # every hung check: published unscored, and dead-lettered alone with its reason
    failed = {s.sample_id: s for g in groups for s in g.samples if s.verifier_error}
    assert failed, "no check hung: the test injected nothing"
    for s in failed.values():
        assert s.reward == 0.0 and "timed out" in (s.verifier_error or ""), s.verifier_error
    known = {s.sample_id for g in groups for s in g.samples}  # a later group's: not read
    letters = [d for d in dead if d.reason == "verifier_timeout"]
    lettered = [i for d in letters if (i := json.loads(d.payload)["sample_id"]) in known]
    assert sorted(lettered) == sorted(failed), (lettered, sorted(failed))
    assert all(d.service == "rollout" and "timed out" in d.error for d in letters)

    # the batch: the group's scored samples alone, and their advantages
    (trained,) = batch.groups
    (sent,) = [g for g in groups if g.group_id == trained.group_id]
    scored = [s for s in sent.samples if s.verifier_error is None]
    assert len(scored) < len(sent.samples), "the trained group had no failed member"
    assert [s.sample_id for s in trained.samples] == [s.sample_id for s in scored]
    loss = LossConfig()  # GRPO, as the run's trainer would
    got = trained_advantages(batch, loss)
    want = reference([s.reward for s in scored], loss.advantage, loss.advantage_eps)
    assert len(got) == len(want)
    close = [math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(got, want, strict=True)]
    assert all(close), (got, want)


async def run(
    url: str, tmp_path: Path, model: Path, engines: EngineStates
) -> tuple[list[SampleGroup], list[DeadLetter], TrainBatch]:
    """Until the buffer publishes a batch whose group lost a member to a hung check: the
    groups the worker published, every dead letter, and that batch."""
    config = config_for(tmp_path, url)
    nats_settings = NatsSettings(url=url, connect_attempts=3)
    nc = await connect(nats_settings, "test")
    await ensure_streams(nc.jetstream(), streams_for(RUN))
    await nc.close()
    log = tmp_path / "buffer.log"
    buffer = start_buffer(config, log)
    streams = {w: stream_name(RUN, w) for w in ("SAMPLES", "DLQ", "BATCHES")}
    async with serving_engine(engines.get()) as engine_url:
        settings = load_settings(
            RolloutSettings, config, nats=nats_settings, engine_url=engine_url,
            engine_id="engine-0", worker_id="rollout-0", model=model,
            weights_dir=tmp_path / "engine-weights",
        )  # fmt: skip
        stop = asyncio.Event()
        service = asyncio.create_task(
            run_service("rollout", settings, rollout_body, stop=stop,
                        registry=CollectorRegistry(), handle_signals=False)
        )  # fmt: skip
        try:
            while True:
                assert buffer.poll() is None, log.read_text()[-3000:]
                assert not service.done(), service
                got = await read_stream_async(url, streams["BATCHES"], S.batches)
                groups = [
                    decode(b, SampleGroup)
                    for b in await read_stream_async(url, streams["SAMPLES"], S.samples)
                ]
                lost = {g.group_id for g in groups if any(s.verifier_error for s in g.samples)}
                batches = [decode(b, TrainBatch) for b in got]
                hit = [b for b in batches if b.groups[0].group_id in lost]
                if hit:
                    break
                assert len(batches) < 3, "three batches, none of a group with a hung check"
                await asyncio.sleep(0.5)
            dead = [
                decode(b, DeadLetter)
                for b in await read_stream_async(url, streams["DLQ"], S.dlq_all)
            ]
        finally:
            stop.set()
            await asyncio.wait_for(service, 60)
            buffer.terminate()
            buffer.wait(timeout=20)
    return groups, dead, hit[0]

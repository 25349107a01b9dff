"""`flywheel trace` on a real run: live (its NATS up) and finished (its store opened again).

One short real run, as `flywheel up` plans it (tests/harness/stack.py): a
tiny model, two CPU engines each with its rollout worker, sync, trainer
(3 steps) and buffer over a real nats-server whose store is the run's
`<run_dir>/nats`. A message that is no SampleGroup is published on the
samples subject, so the buffer dead-letters it: the timeline must show it.
The trace is taken once while the run goes (`--nats`) and once after
everything stopped (no `--nats`: the stopped run's store, as a user traces
a finished run), and both are checked against the Trace Event Format
(tests/harness/trace_format.py) and against the streams themselves.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from proto.codec import decode
from proto.messages import SampleGroup, TrainBatch, WeightsPublished
from proto.streams import stream_name
from proto.subjects import Subjects
from services.replay.timeline import PID_DLQ, PID_ENGINES, PID_SAMPLES, PID_TRAINER
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table
from tests.harness.streams import messages, read_stream
from tests.harness.trace_format import problems
from tests.harness.up import flywheel

RUN = "traced"
STEPS = 3
S = Subjects(RUN)
GARBAGE = b"not a sample group"
pytestmark = pytest.mark.slow


def config_text(root: Path, model: Path) -> str:
    return run_file(
        RUN,
        stack=stack_table(root, model, engines=2, embedded_nats=True),
        buffer={"samples_per_prompt": 4, "groups_per_step": 2, "max_new_tokens": 6,
                "max_staleness": 1, "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 2, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
        engine={"num_threads": 1},
        trainer={"publish_every": 1, "max_steps": STEPS, "runtime": {"cpu_threads": 1}},
        sync={"liveness_s": 3.0, "tick_s": 0.1, "keep_last": 10},
    ) + '\n[task]\nsource = { type = "arithmetic", digits = 1 }\n'  # fmt: skip


async def publish_raw(url: str, subject: str, data: bytes) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish(subject, data)
    finally:
        await nc.close()


def dlq_count(url: str) -> int:
    async def go() -> int:
        import nats

        nc = await nats.connect(url)
        try:
            return (await nc.jetstream().stream_info(stream_name(RUN, "DLQ"))).state.messages
        finally:
            await nc.close()

    return asyncio.run(go())


def trace(config: Path, out: Path, *more: str) -> dict:
    p = flywheel("trace", "-c", str(config), "-o", str(out), *more, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Open it in ui.perfetto.dev" in p.stdout, p.stdout
    doc = json.loads(out.read_text())
    assert problems(doc) == [], problems(doc)[:10]
    return doc


def test_a_run_traced_live_and_finished(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(config_text(tmp_path, tiny_model))
    with NatsServer(store_dir=tmp_path / "nats") as nats:
        with Stack(config, nats.url) as st, printing_logs_on_failure(st):
            st.start("engine-0", "engine-1", "rollout-0", "rollout-1")
            st.start("sync", "trainer")
            st.start("buffer")
            wait_for(lambda: st.trained_steps() >= 1, 240, "a first step trained")
            asyncio.run(publish_raw(nats.url, S.samples, GARBAGE))
            wait_for(lambda: dlq_count(nats.url) >= 1, 60, "the buffer dead-letters it")
            live = trace(config, tmp_path / "live.json", "--nats", nats.url)
            wait_for(lambda: st.trained_steps() >= STEPS, 240, f"{STEPS} steps trained")
            wait_for(lambda: not st["trainer"].alive, 60, "the trainer stops at max_steps")
        raw = read_stream(nats.url, stream_name(RUN, "SAMPLES"), S.samples)
        groups = [decode(b, SampleGroup) for b in raw if b != GARBAGE]
        batches = messages(nats.url, RUN, "BATCHES", S.batches, TrainBatch)
        published = messages(nats.url, RUN, "WEIGHTS", S.weights_published, WeightsPublished)
    assert live["otherData"]["batches"] >= 1 and live["otherData"]["dead_letters"] >= 1
    # the run has stopped, NATS too: the trace opens its store itself
    doc = trace(config, tmp_path / "done.json")
    o = doc["otherData"]
    assert o["sample_groups"] == len(groups) and o["batches"] == len(batches)
    assert o["samples"] == sum(len(g.samples) for g in groups)
    assert o["versions_published"] == len(published) >= STEPS
    assert o["undecodable"] == 1  # the garbage on the samples subject, left out
    ev = doc["traceEvents"]
    # a slice per sample; every trained sample's slice reaches its step's publication
    lives = {e["name"]: e for e in ev if e["ph"] == "X" and e["pid"] == PID_SAMPLES
             and e["name"] == e.get("args", {}).get("sample")}  # fmt: skip
    assert set(lives) == {s.sample_id for g in groups for s in g.samples}
    # the buffer may have batched past max_steps: those batches were never trained
    trained = {g.group_id for b in batches if b.step < STEPS for g in b.groups}
    t0 = o["t0_unix"]
    at = {w.step: w.published_at for w in published}
    for g in groups:
        for s in g.samples:
            life = lives[s.sample_id]
            assert life["ts"] == pytest.approx((s.queued_at - t0) * 1e6, abs=1)
            if g.group_id in trained:
                step = life["args"]["step"]
                end = (life["ts"] + life["dur"]) / 1e6 + t0
                # WeightsPublished.step counts steps done: batch k is in version k + 1
                assert end == pytest.approx(at[step + 1], abs=1e-5), s.sample_id
    # both engines have their track; the trainer its steps; the dead letter its reason
    threads = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"}
    assert {n for p, n in threads if p == PID_ENGINES} >= {
        "engine-0 (worker rollout-0)", "engine-1 (worker rollout-1)"}  # fmt: skip
    steps = [e["name"] for e in ev if e["ph"] == "X" and e["pid"] == PID_TRAINER]
    assert [f"step {i}" for i in range(STEPS)] == steps[:STEPS]
    dead = [e for e in ev if e["ph"] == "i" and e["pid"] == PID_DLQ]
    assert dead and all(e["args"]["reason"] for e in dead)
    assert {f"v{v} published" for v in range(1, STEPS + 1)} <= {
        e["name"] for e in ev if e["ph"] == "i"}  # fmt: skip

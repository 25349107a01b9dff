"""Bad input to the rollout worker (`tasks`), the trainer (`batches`) and sync (corrupt weights).

One small stack per module, as real subprocesses on a real nats-server: a
CPU engine, its rollout worker, sync and the trainer (no buffer: the test
plays the buffer, publishing tasks and batches itself).

- `tasks` / `batches`: garbage, truncated, wrong type, schema major 2, a
  wrong-typed field → each dead-lettered with its reason, keeping the
  bytes; then a good task gets its SampleGroup / a good batch is trained.
- a corrupt weights directory (a flipped byte: its sha256 no longer matches
  the manifest) announced as WeightsPublished → the engine refuses it, sync
  counts the failure (`flywheel_sync_update_failures_total`), logs it and
  retries; the trainer meanwhile trains the next batch.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from proto.codec import decode, encode
from proto.examples import EXAMPLES
from proto.messages import (
    DeadLetter,
    Message,
    PromptTask,
    SampleGroup,
    SamplingParams,
    TrainBatch,
    WeightsPublished,
)
from proto.streams import stream_name
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from services.weights import read_manifest
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table
from tests.harness.streams import messages, publish_raw, read_stream

RUN = "badwork"
S = Subjects(RUN)
pytestmark = pytest.mark.slow  # a stack: engine, rollout worker, sync, trainer


def _with(msg: Message, **changes: Any) -> bytes:
    body = msgpack.unpackb(encode(msg), raw=False)
    body.update(changes)
    return msgpack.packb(body, use_bin_type=True)


def bad_inputs(valid: Message, wrong: Message) -> list[tuple[str, bytes, str]]:
    data = encode(valid)
    return [
        ("garbage", b"\xc1 not msgpack at all", "malformed"),
        ("truncated", data[: len(data) // 2], "malformed"),
        ("wrong type", encode(wrong), "wrong_type"),
        ("schema major 2", _with(valid, schema_version="2.0"), "version"),
        ("wrong field type", _with(valid, run=["not", "a", "string"]), "schema"),
    ]


def dead_letters(st: Stack, subject: str) -> list[DeadLetter]:
    raw = read_stream(st.nats_url, stream_name(RUN, "DLQ"), S.dlq_all)
    return [d for d in (decode(b, DeadLetter) for b in raw) if d.subject == subject]


def task(i: int) -> PromptTask:
    return PromptTask(
        run=RUN, task_id=f"{RUN}:e0:i{i}", epoch=0, index=i, task_name="arithmetic", prompt="1+2=",
        answer="3", n=2, sampling=SamplingParams(max_new_tokens=4), min_weight_version=0,
        created_at=time.time(),
    )  # fmt: skip


def group_of(st: Stack, task_id: str) -> SampleGroup | None:
    groups = messages(st.nats_url, RUN, "SAMPLES", S.samples, SampleGroup)
    return next((g for g in groups if g.task_id == task_id), None)


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("badwork")
    config = root / "run.toml"
    config.write_text(
        run_file(
            RUN,
            stack=stack_table(root, tiny_model, engines=1),
            task={"source": {"type": "arithmetic"}},
            rollout={"concurrency": 2, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
            engine={"num_threads": 1},
            trainer={"publish_every": 1, "runtime": {"cpu_threads": 1}},
            sync={"liveness_s": 3.0, "tick_s": 0.1, "retry_backoff_s": 0.2},
        )
    )
    with NatsServer(store_dir=root / "nats") as nats, Stack(config, nats.url) as st:
        with printing_logs_on_failure(st):
            st.start("engine-0", "rollout-0")  # the worker waits for its engine
            st.start("sync", "trainer")  # no buffer: the test plays it
        yield st


def check_letters(st: Stack, subject: str, bad: list[tuple[str, bytes, str]], who: str) -> None:
    got = wait_for(lambda: (d := dead_letters(st, subject)) and len(d) >= len(bad) and d, 30,
                   f"{len(bad)} dead letters on {subject}")  # fmt: skip
    assert [d.reason for d in got] == [r for _, _, r in bad], [(d.reason, d.error) for d in got]
    for d, (what, data, _) in zip(got, bad, strict=True):
        assert d.payload == data and d.error and d.service == who, what


def test_rollout_worker_dead_letters_bad_tasks_and_goes_on(stack: Stack) -> None:
    st = stack
    bad = bad_inputs(task(0), EXAMPLES["WeightsReady"])
    publish_raw(st.nats_url, S.tasks, [d for _, d, _ in bad])
    check_letters(st, S.tasks, bad, "rollout")
    publish_raw(st.nats_url, S.tasks, [encode(task(1))])
    g = wait_for(lambda: group_of(st, task(1).task_id), 60, "the good task's group")
    assert len(g.samples) == 2 and g.worker_id == "rollout-0"
    assert st["rollout-0"].alive
    assert len(dead_letters(st, S.tasks)) == len(bad)  # the good one was not dead-lettered


def batch(st: Stack, step: int) -> TrainBatch:
    """A real batch: two groups the worker generates for it."""
    tasks = [task(100 + 2 * step + j) for j in range(2)]
    publish_raw(st.nats_url, S.tasks, [encode(t) for t in tasks])
    groups = [wait_for(lambda t=t: group_of(st, t.task_id), 60, "a group") for t in tasks]
    return TrainBatch(run=RUN, batch_id=f"{RUN}:step{step}", step=step, groups=tuple(groups),
                      created_at=time.time())  # fmt: skip


def test_trainer_dead_letters_bad_batches_and_trains_the_next(stack: Stack) -> None:
    st = stack
    good = batch(st, 0)
    bad = bad_inputs(good, EXAMPLES["WeightsReady"])
    publish_raw(st.nats_url, S.batches, [d for _, d, _ in bad] + [encode(good)])
    check_letters(st, S.batches, bad, "trainer")
    wait_for(lambda: st.trained_steps() >= 1, 60, "step 1 trained")
    assert [r["batch_id"] for r in st.trained_rows()] == [f"{RUN}:step0"]
    assert st["trainer"].alive


def test_corrupt_weights_are_refused_sync_retries_and_the_trainer_goes_on(
    stack: Stack,
) -> None:
    st = stack
    wait_for(lambda: st.trained_steps() >= 1, 60, "step 1 trained")
    good = st.weights / RUN / "v000001"
    wait_for(lambda: (st.engine_version(0) or 0) >= 1, 60, "engine at v1")
    sync = st["sync"]
    failures0 = sync.metric("flywheel_sync_update_failures_total", 'engine="engine-0"') or 0.0
    # v50: a copy of v1 with one flipped byte in the safetensors file
    bad = st.weights / RUN / "v000050"
    shutil.copytree(good, bad)
    shard = next(bad.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    m = read_manifest(bad)
    msg = WeightsPublished(run=RUN, version=50, step=50, uri=bad.resolve().as_uri(),
                           sha256=m.sha256, size_bytes=m.total_bytes)  # fmt: skip
    publish_raw(st.nats_url, S.weights_published, [encode(msg)])

    def failures() -> float:
        return sync.metric("flywheel_sync_update_failures_total", 'engine="engine-0"') or 0.0

    wait_for(lambda: failures() >= failures0 + 2, 30, "sync retried the corrupt version")
    assert st.engine_version(0) == 1  # refused: still serving the good version
    assert "failed to load v50" in sync.log() and "sha256" in sync.log()
    # The trainer is not blocked: it trains the next batch (and publishes v2).
    publish_raw(st.nats_url, S.batches, [encode(batch(st, 1))])
    wait_for(lambda: st.trained_steps() >= 2, 60, "step 2 trained despite the corrupt v50")
    assert all(st[n].alive for n in ("engine-0", "rollout-0", "sync", "trainer"))

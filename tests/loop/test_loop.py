"""The closed loop as real subprocesses over a real nats-server, weights over NATS.

One stack per module (starting torch in six processes is the expensive
part), as `flywheel up` plans and supervises it (tests/harness/stack.py):
two CPU engines with their rollout workers, sync, trainer, buffer; a third
engine and worker planned but started by a test. Weights travel over NATS
(`weights_transport = "nats"`): no directory is shared with the engines;
sync has a weights root of its own, empty. (The shared-directory transport
runs the loop in test_update_modes.py, the chaos suite and the e2e runs.)

The tests run in file order against it and each checks relative to the
state it finds: every engine follows every version within the staleness
bound; each version reached every engine as chunks in JetStream, each
worker verified its own copy, old versions' chunks leave the stream; the
trainer survives kill -9 with a gap-free, duplicate-free batch sequence; an
engine that joins mid-run is brought to the latest version before it
serves a task; an engine that dies does not stop the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proto.messages import SampleGroup, TrainBatch, WeightsReady
from proto.streams import stream_name
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, stack_table, start_loop
from tests.harness.streams import messages, published_versions

RUN = "loop"
STALENESS = 1
S = Subjects(RUN)
pytestmark = pytest.mark.slow


def loop_config(run: str, root: Path, model: Path, engines: int = 2, **trainer: object) -> str:
    return run_file(
        run,
        stack=stack_table(root, model, engines),
        task={"source": {"type": "arithmetic", "digits": 1}},
        buffer={"samples_per_prompt": 4,
                "groups_per_step": 2, "max_new_tokens": 4, "max_staleness": STALENESS,
                "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 4, "heartbeat_s": 0.3, "weights_poll_s": 0.5,
                 "behind_retry_s": 0.2},
        engine={"num_threads": 1},
        trainer={"publish_every": 1, "keep_checkpoints": 2, **trainer,
                 "runtime": {"cpu_threads": 1}, "optim": {"lr": 1e-3}},
        sync={"liveness_s": 3.0, "tick_s": 0.1, "retry_backoff_s": 0.2, "keep_last": 2},
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("loop")
    config = root / "run.toml"
    config.write_text(loop_config(RUN, root, tiny_model, engines=3, weights_transport="nats"))
    assert 'weights_transport = "nats"' in config.read_text()
    # sync gets a weights root of its own: it must not need the trainer's files
    # (the variable is only sync's; the harness gives it to every process)
    no_weights = {"FLYWHEEL_SYNC_WEIGHTS_ROOT": str(root / "sync-has-no-weights")}
    with (
        NatsServer(store_dir=root / "nats") as nats,
        Stack(config, nats.url, env=no_weights) as st,
    ):
        start_loop(st)
        yield st


def ready(st: Stack) -> list[WeightsReady]:
    return messages(st.nats_url, RUN, "WEIGHTS", S.weights_ready, WeightsReady)


def latest_ready(st: Stack) -> int:
    return max((r.version for r in ready(st)), default=0)


def test_every_engine_follows_every_step_within_the_staleness_bound(stack: Stack) -> None:
    st = stack
    for v in (1, 2, 3):
        wait_for(lambda v=v: st.trained_steps() >= v, 90, f"trainer step {v}")
        # Each new version reaches both engines (the next ones may already be on their way).
        wait_for(lambda v=v: all((st.engine_version(i) or 0) >= v for i in (0, 1)), 30,
                 f"both engines at v{v}")  # fmt: skip
    # v0 (the initial weights) may be announced as soon as the first engine registers
    announced = [r for r in ready(st) if r.version >= 1]
    assert announced, "sync announced nothing"
    assert all(set(r.engines) == {"engine-0", "engine-1"} for r in announced), announced
    assert [r.version for r in announced] == sorted({r.version for r in announced})
    for b in messages(st.nats_url, RUN, "BATCHES", S.batches, TrainBatch):
        for g in b.groups:
            for smp in g.samples:
                assert smp.weight_version >= b.step - STALENESS, (b.batch_id, smp.sample_id)
    # sync's own view agrees with the engines
    for i in (0, 1):
        v = st["sync"].metric("flywheel_sync_engine_version", f'engine="engine-{i}"')
        assert v is not None and v >= 3


def chunk_versions(nats_url: str) -> set[int]:
    """The versions whose chunks the WEIGHTDATA stream holds."""
    import asyncio

    import nats

    async def body() -> set[int]:
        nc = await nats.connect(nats_url)
        try:
            info = await nc.jetstream().stream_info(
                stream_name(RUN, "WEIGHTDATA"), subjects_filter=S.weightdata_all
            )
            return {int(s.rsplit(".v", 1)[1]) for s in (info.state.subjects or {})}
        finally:
            await nc.close()

    return asyncio.run(body())


def test_weights_travel_over_nats_to_each_engines_own_copy(stack: Stack) -> None:
    st = stack
    wait_for(lambda: all((st.engine_version(i) or 0) >= 4 for i in (0, 1)), 90,
             "both engines at v4")  # fmt: skip
    pubs = list(published_versions(st.nats_url, RUN).values())
    assert pubs and all(p.uri.startswith("nats://") for p in pubs), pubs
    for i in (0, 1):
        # each engine loaded its own verified copy, not the trainer's directory
        local = (st.root / f"engine-weights-{i}").resolve()
        path = Path((st.engine_info(i) or {})["model_path"])
        assert path.is_relative_to(local), path
        got = st[f"rollout-{i}"].metric("flywheel_rollout_weights_downloaded_version")
        assert got is not None and got >= 4
    # keep_last = 2: the chunks of old versions leave the stream
    wait_for(lambda: 1 not in chunk_versions(st.nats_url), 30, "v1 chunks purged")
    assert chunk_versions(st.nats_url), "the newest versions' chunks are kept"


def test_trainer_kill9_resumes_without_gaps_or_repeats(stack: Stack) -> None:
    st = stack
    trainer = st["trainer"]
    before = st.trained_steps()
    wait_for(lambda: st.trained_steps() > before, 60, "a new trainer step")
    trainer.kill9()  # right after a step's row: mid-run, between steps or inside the next one
    killed_at = st.trained_steps()
    trainer.restart()
    wait_for(lambda: st.trained_steps() >= killed_at + 2, 90, "two steps after the restart")
    rows = st.trained_rows()
    steps = [int(r["step"]) for r in rows]
    ids = [r["batch_id"] for r in rows]
    assert steps == list(range(1, len(steps) + 1)), steps  # gap-free and duplicate-free
    assert ids == [f"{RUN}:step{s - 1}" for s in steps]
    assert "resumed from" in trainer.log()


def test_engine_added_mid_run_serves_the_latest_version_first(stack: Stack) -> None:
    st = stack
    wait_for(lambda: latest_ready(st) >= 3, 60, "v3 ready")
    joined_at = max(published_versions(st.nats_url, RUN))
    st.start("engine-2", "rollout-2")  # together: the worker waits for its engine

    def first_group() -> SampleGroup | None:
        groups = messages(st.nats_url, RUN, "SAMPLES", S.samples, SampleGroup)
        return next((g for g in groups if g.worker_id == "rollout-2"), None)

    g = wait_for(first_group, 90, "a group from the new engine")
    # It started at v0; its first group is of the version published when it joined, or newer.
    assert g.weight_version >= joined_at, (g.weight_version, joined_at)


def test_engine_killed_mid_run_does_not_stop_sync(stack: Stack) -> None:
    st = stack
    st["engine-0"].kill9()
    announced = latest_ready(st)

    def without_engine_0() -> WeightsReady | None:
        # a version engine-0 loaded before it died may be announced after `announced` was
        # read (sync behind under load): wait for the newest to leave it out
        last = max(ready(st), key=lambda r: r.version)
        return last if last.version >= announced + 2 and "engine-0" not in last.engines else None

    last = wait_for(without_engine_0, 90, "two more versions ready, without engine-0")
    assert {"engine-1", "engine-2"} <= set(last.engines)

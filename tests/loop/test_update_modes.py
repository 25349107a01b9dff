"""Partial rollouts across weight updates, end to end, for each pausing `update_mode`.

One stack for the module (two CPU engines slowed down so that updates land
mid-generation, their rollout workers, trainer, buffer; real NATS). Each
test runs sync in one mode for a few versions, then stops it; the next test
starts sync in the next mode. So the three modes share one start-up, and
the updates of a phase are exactly those to versions above what the engines
served when its sync started.

For every mode: every trained sample's first version is within the
staleness bound of its step (the bound applies to the oldest token, as
services/buffer/core.py documents), no sample is trained twice, the
trainer's steps have no gap, nothing is dead-lettered. Then per mode:

- retract, in_place: samples whose tokens span an update reach the
  trainer's batches with their per-token spans (first and last version),
  and nothing is aborted;
- abort: in-flight generations are aborted and generated again (the
  workers count them), so no trained sample spans an update of this phase.

Each phase prints what it cost (aborted generations, spanning samples,
publish→ready latency): the GPU default (docs/sglang.md) was
picked from these.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proto.messages import DeadLetter, Sample, TrainBatch, WeightsPublished, WeightsReady
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.probe import post_json
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table
from tests.harness.streams import messages

RUN = "modes"
STALENESS = 1
S = Subjects(RUN)
VERSIONS_PER_PHASE = 3
# Engine sleep after each decode step, per attempt: a generation takes ~0.5 s at
# the first. An update finds a generation in flight only while generating the
# next batch takes longer than the trainer's step; on a loaded machine the step
# is slower, so each further attempt slows the engines again.
SLOW_S = (0.03, 0.15, 0.6)


def modes_config(root: Path, model: Path) -> str:
    return run_file(
        RUN,
        stack=stack_table(root, model),
        task={"source": {"type": "arithmetic", "digits": 1}},
        buffer={"samples_per_prompt": 4,
                "groups_per_step": 2, "max_new_tokens": 16, "max_staleness": STALENESS,
                "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 4, "heartbeat_s": 0.3, "weights_poll_s": 0.5,
                 "behind_retry_s": 0.2},
        engine={"num_threads": 1},
        trainer={"publish_every": 1, "keep_checkpoints": 2, "runtime": {"cpu_threads": 1},
                 "optim": {"lr": 1e-3}},
        sync={"liveness_s": 3.0, "tick_s": 0.1, "retry_backoff_s": 0.2, "keep_last": 3},
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("modes")
    config = root / "run.toml"
    config.write_text(modes_config(root, tiny_model))
    with NatsServer(store_dir=root / "nats") as nats, Stack(config, nats.url) as st:
        with printing_logs_on_failure(st):
            st.start("engine-0", "engine-1")
            slow_engines(st, SLOW_S[0])
            st.start("rollout-0", "rollout-1", "trainer")  # sync: one per phase, by the test
            st.start("buffer")
        yield st


def slow_engines(st: Stack, seconds: float) -> None:
    """SGLang's /slow_down: requests are mid-flight when updates come."""
    for i in (0, 1):
        post_json(f"{st[f'engine-{i}'].url}/slow_down", {"forward_sleep_time": seconds})


def ready(st: Stack) -> list[WeightsReady]:
    return messages(st.nats_url, RUN, "WEIGHTS", S.weights_ready, WeightsReady)


def aborted(st: Stack) -> float:
    return sum(st[f"rollout-{i}"].metric("flywheel_rollout_aborted_generations_total")
               or 0.0 for i in (0, 1))  # fmt: skip


def batched(st: Stack) -> list[tuple[int, Sample]]:
    """(step, sample) of every sample in a train batch: what the trainer is given."""
    batches = messages(st.nats_url, RUN, "BATCHES", S.batches, TrainBatch)
    return [(b.step, smp) for b in batches for g in b.groups for smp in g.samples]


def run_phase(st: Stack, mode: str) -> dict[str, Any]:
    """Sync in `mode` until VERSIONS_PER_PHASE more versions are ready everywhere."""
    floor = min(st.engine_version(i) or 0 for i in (0, 1))
    aborted_before = aborted(st)
    sync = st.variant("sync", f"sync-{mode}", {"FLYWHEEL_SYNC_UPDATE_MODE": mode})
    sync.start()
    target = floor + VERSIONS_PER_PHASE
    try:
        wait_for(lambda: all((st.engine_version(i) or 0) >= target for i in (0, 1)), 150,
                 f"both engines at v{target} in {mode} mode")  # fmt: skip
        wait_for(lambda: st.trained_steps() >= target + 1, 90, "a batch of the last version")
    finally:
        sync.stop()
    top = min(st.engine_version(i) or 0 for i in (0, 1))
    published = {p.version: p.published_at for p in messages(
        st.nats_url, RUN, "WEIGHTS", S.weights_published, WeightsPublished)}  # fmt: skip
    latency = [r.ready_at - published[r.version] for r in ready(st)
               if floor < r.version <= top and r.version in published]  # fmt: skip
    return {"floor": floor, "top": top, "aborted": aborted(st) - aborted_before,
            "latency": latency, "sync_log": sync.log()}  # fmt: skip


def crosses_into_phase(smp: Sample, floor: int, top: int) -> bool:
    """Its tokens span an update to a version this phase's sync made."""
    spans = smp.weight_version_spans
    return any(floor < b.version <= top for _, b in itertools.pairwise(spans))


def check_whole_run(st: Stack) -> list[tuple[int, Sample]]:
    samples = batched(st)
    ids = [smp.sample_id for _, smp in samples]
    assert len(ids) == len(set(ids)), "a sample was batched twice"
    for step, smp in samples:
        assert smp.weight_version >= step - STALENESS, (step, smp.sample_id, smp.weight_version)
        assert smp.finish_reason != "abort", (smp.sample_id, smp.weight_version_spans,
                                              smp.num_response_tokens)  # fmt: skip
        if smp.weight_version_spans:  # the engine reports them (SGLang >= 0.5.19 does)
            assert smp.weight_version_spans[0].version == smp.weight_version
            assert smp.weight_version_spans[-1].version == smp.weight_version_last
    steps = [int(r["step"]) for r in st.trained_rows()]
    assert steps == list(range(1, len(steps) + 1)), steps
    # A group too old for its step is dead-lettered "stale" by design (the bound
    # holds for what is trained); any other reason is a task lost.
    dead = [d for d in messages(st.nats_url, RUN, "DLQ", S.dlq_all, DeadLetter)
            if d.reason != "stale"]  # fmt: skip
    assert dead == [], [(d.reason, d.error) for d in dead]
    return samples


def report(mode: str, phase: dict[str, Any], spanning: int, total: int) -> None:
    lat = statistics.median(phase["latency"]) if phase["latency"] else float("nan")
    print(f"\n[{mode}] v{phase['floor']}->v{phase['top']}: aborted generations "
          f"{phase['aborted']:.0f}, trained samples spanning an update {spanning}/{total}, "
          f"publish->ready median {lat:.2f}s")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_partial_rollouts_keep_their_tokens_and_versions(stack: Stack, mode: str) -> None:
    # A span needs an update to land while a generation is in flight. When the
    # trainer is the bottleneck (a loaded machine), admission can have the
    # engines idle at every update of a phase; so up to three phases, until
    # one trained sample spans an update (what this test is about).
    floor, aborted_total = None, 0.0
    for slow in SLOW_S:
        slow_engines(stack, slow)
        phase = run_phase(stack, mode)
        floor = phase["floor"] if floor is None else floor
        aborted_total += phase["aborted"]
        samples = check_whole_run(stack)
        spanning = [smp for _, smp in samples if crosses_into_phase(smp, floor, phase["top"])]
        report(mode, phase, len(spanning), len(samples))
        if spanning:
            break
    slow_engines(stack, SLOW_S[0])
    assert aborted_total == 0, "a pausing mode that keeps requests aborted some"
    assert spanning, f"no trained sample spans a {mode} update (spans reach the trainer)"
    for smp in spanning:
        assert smp.weight_version < smp.weight_version_last
        assert len(smp.weight_version_spans) >= 2


@pytest.mark.slow
def test_abort_regenerates_what_it_aborts(stack: Stack) -> None:
    # As above: up to three phases, until an update finds a generation in
    # flight (CI runs have had the engines idle at all three of a phase's, twice).
    for slow in SLOW_S:
        slow_engines(stack, slow)
        phase = run_phase(stack, "abort")
        samples = check_whole_run(stack)
        spanning = [smp for _, smp in samples
                    if crosses_into_phase(smp, phase["floor"], phase["top"])]  # fmt: skip
        report("abort", phase, len(spanning), len(samples))
        assert spanning == []  # aborted ones started again, on the new version only
        if phase["aborted"] >= 1:
            break
    slow_engines(stack, SLOW_S[0])
    assert phase["aborted"] >= 1, (
        "no generation was in flight at any abort-mode update\n"
        + phase["sync_log"][-3000:]
        + stack["rollout-0"].log()[-3000:]
        + stack["engine-0"].log()[-2000:]
    )

"""services/replay/timeline.py: a run's records -> Chrome trace events, without a server."""

from __future__ import annotations

import itertools
import json

from proto.messages import (
    DeadLetter,
    FinishReason,
    Sample,
    SampleGroup,
    TrainBatch,
    WeightsPublished,
    WeightsReady,
    pack_f32,
    pack_i32,
    pack_u8,
)
from services.replay.timeline import (
    PID_DLQ,
    PID_ENGINES,
    PID_SAMPLES,
    PID_SYNC,
    PID_TRAINER,
    Records,
    Slice,
    pack_lanes,
    trace_document,
)
from tests.harness.trace_format import problems

T = 1_700_000_000.0  # the run's first recorded time (unix seconds)
RUN = "tl"


def sample(gid: str, i: int, *, queued: float, started: float, finished: float,
           engine: str = "engine-0", version: int = 0) -> Sample:  # fmt: skip
    return Sample(sample_id=f"{gid}:s{i}", group_id=gid, task_id=f"{gid}-task", index=i,
                  prompt_ids=pack_i32([1, 2]), response_ids=pack_i32([3, 4, 5]),
                  logprobs=pack_f32([-0.1] * 3), loss_mask=pack_u8([1] * 3), reward=1.0,
                  finish_reason=FinishReason.STOP, weight_version=version,
                  weight_version_last=version, engine_id=engine, queued_at=T + queued,
                  started_at=T + started, finished_at=T + finished)  # fmt: skip


def group(gid: str, created: float, *samples: Sample, worker: str = "rollout-0") -> SampleGroup:
    return SampleGroup(run=RUN, group_id=gid, task_id=f"{gid}-task", env="arith",
                       worker_id=worker, samples=samples, created_at=T + created)  # fmt: skip


def records() -> Records:
    """Two groups of two samples on two engines at once; g0 trained in step 0 (v1 published
    at +10, ready at +11), g1 never batched; one dead letter."""
    g0 = group("g0", 3.0, sample("g0", 0, queued=0.0, started=1.0, finished=2.0),
               sample("g0", 1, queued=0.0, started=1.0, finished=3.0))  # fmt: skip
    g1 = group("g1", 4.0, sample("g1", 0, queued=0.5, started=1.5, finished=4.0,
                                 engine="engine-1"), worker="rollout-1")  # fmt: skip
    batch = TrainBatch(run=RUN, batch_id="b0", step=0, groups=(g0,), created_at=T + 5.0)
    pub = WeightsPublished(run=RUN, version=1, step=1, uri="file:///w/v1", sha256="0" * 64,
                           size_bytes=10, published_at=T + 10.0)  # fmt: skip
    ready = WeightsReady(run=RUN, version=1, engines=("engine-0",), ready_at=T + 11.0)
    dead = DeadLetter(run=RUN, reason="stale", error="v0 older than the bound", subject="s",
                      payload=b"x", service="buffer", at=T + 6.0)  # fmt: skip
    return Records(RUN, [g0, g1], [batch], [pub], [ready], [dead])


def events(doc: dict, ph: str, pid: int | None = None) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == ph and (pid is None or e["pid"] == pid)]


def test_the_document_is_a_valid_trace_and_survives_json() -> None:
    doc = json.loads(json.dumps(trace_document(records())))
    assert problems(doc) == []
    assert doc["otherData"]["samples"] == 3 and doc["otherData"]["t0_unix"] == T


def test_a_sample_is_one_slice_from_dispatch_to_training_with_its_phases_nested() -> None:
    doc = trace_document(records())
    xs = events(doc, "X", PID_SAMPLES)
    life = next(e for e in xs if e["name"] == "g0:s1")
    assert (life["ts"], life["dur"]) == (0.0, 10e6)  # dispatched at T, trained by v1 at +10
    assert life["args"]["step"] == 0 and life["args"]["batch"] == "b0"
    assert life["args"]["engine"] == "engine-0" and life["args"]["response_tokens"] == 3
    phases = [(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in xs
              if e["tid"] == life["tid"] and life["ts"] <= e["ts"] < life["ts"] + life["dur"]
              and e is not life]  # fmt: skip
    assert phases == [("queued", 0.0, 1.0), ("generate+score", 1.0, 3.0),
                      ("buffered", 3.0, 5.0), ("train step 0", 5.0, 10.0)]  # fmt: skip
    # a sample never batched ends when its group was made
    never = next(e for e in xs if e["name"] == "g1:s0")
    assert never["ts"] == 0.5e6 and never["ts"] + never["dur"] == 4e6
    assert never["args"]["step"] is None


def test_concurrent_samples_take_separate_lanes_and_each_engine_has_its_track() -> None:
    doc = trace_document(records())
    lives = [e for e in events(doc, "X", PID_SAMPLES) if ":s" in e["name"]]
    assert len({e["tid"] for e in lives}) == 3  # all three overlap in time
    names = {e["args"]["name"] for e in events(doc, "M", PID_ENGINES) if e["name"] == "thread_name"}
    assert names == {"engine-0 (worker rollout-0)", "engine-0 (worker rollout-0) #2",
                     "engine-1 (worker rollout-1)"}  # fmt: skip


def test_versions_are_global_markers_and_sync_loads_between_them() -> None:
    doc = trace_document(records())
    marks = {e["name"]: e for e in events(doc, "i") if e["cat"] == "weights"}
    assert marks["v1 published"]["ts"] == 10e6 and marks["v1 published"]["s"] == "g"
    assert marks["v1 ready"]["ts"] == 11e6 and marks["v1 ready"]["pid"] == PID_SYNC
    load = next(e for e in events(doc, "X", PID_SYNC))
    assert (load["name"], load["ts"], load["dur"]) == ("load v1", 10e6, 1e6)
    step = next(e for e in events(doc, "X", PID_TRAINER))
    assert (step["name"], step["ts"], step["dur"]) == ("step 0", 5e6, 5e6)


def test_a_dead_letter_is_an_instant_with_its_reason_on_its_services_row() -> None:
    doc = trace_document(records())
    (dl,) = events(doc, "i", PID_DLQ)
    assert dl["name"] == "dead letter: stale" and dl["ts"] == 6e6
    assert dl["args"]["reason"] == "stale" and "older" in dl["args"]["error"]
    rows = {e["tid"]: e["args"]["name"] for e in events(doc, "M", PID_DLQ)
            if e["name"] == "thread_name"}  # fmt: skip
    assert rows[dl["tid"]] == "buffer"


def test_lanes_are_disjoint_and_as_few_as_the_overlap_needs() -> None:
    spans = [Slice(str(i), s, e) for i, (s, e) in enumerate([(0, 4), (1, 2), (2, 3), (4, 5)])]
    lanes = pack_lanes(spans)
    assert len(lanes) == 2  # at most two overlap at any time
    for lane in lanes:
        for a, b in itertools.pairwise(lane):
            assert a.end <= b.start


def test_an_empty_run_is_a_valid_trace_of_only_its_tracks() -> None:
    doc = trace_document(Records(RUN))
    assert problems(doc) == [] and doc["otherData"]["samples"] == 0
    assert {e["ph"] for e in doc["traceEvents"]} == {"M"}


def test_the_validator_finds_what_perfetto_would_misdraw() -> None:
    bad = {"traceEvents": [
        {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
        {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5, "dur": 10},  # overlaps a
        {"ph": "X", "name": "c", "pid": 1, "tid": 2, "ts": "0", "dur": -1},
        {"ph": "i", "name": "d", "pid": 1, "tid": 1, "ts": 1, "s": "x"},
        {"ph": "M", "name": "colour", "pid": 1, "args": {}},
    ]}  # fmt: skip
    found = problems(bad)
    assert any("overlaps" in p for p in found)
    assert any("ts '0'" in p for p in found) and any("dur -1" in p for p in found)
    assert any("scope 'x'" in p for p in found) and any("colour" in p for p in found)

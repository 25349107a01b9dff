"""A recorded run as a timeline: its messages -> Chrome Trace Event Format events.

Pure: the records in, a list of trace events (plain dicts) out; no NATS, no
disk. `flywheel trace` (services/replay/trace.py) reads the records and
writes the JSON that ui.perfetto.dev and chrome://tracing open.

Every time drawn is one a message recorded (proto/messages.py), never
one this module guesses at:

- a sample's life starts at its task's dispatch (`Sample.queued_at`, the
  PromptTask's `created_at`), is generated and scored on its engine from
  `started_at` to `finished_at` (the worker stamps `finished_at` after
  scoring, so the two are one slice), waits in the buffer from its group's
  `created_at` until the TrainBatch that carried it (`created_at`), and is
  trained until the first WeightsPublished that counts that batch's step
  among its steps done (`published_at`): the trainer records no start of a step, so a
  step is drawn from when both its batch existed and the step before had
  published.
- weight versions are global instant markers (published, ready); sync's
  loading of a version onto the engines is the slice between the two.
- dead letters are instant events on their service's row, with the reason.

The Trace Event Format forbids nothing, but Perfetto draws slices on one
thread as a stack: two that overlap without nesting are drawn wrongly. So
concurrent slices of one track (samples in flight at once, an engine's
batched requests) are packed greedily into lanes, one thread each, such
that slices on a thread are disjoint. Timestamps are microseconds from the
run's first recorded time (`otherData.t0_unix` says which).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proto.messages import DeadLetter, SampleGroup, TrainBatch, WeightsPublished, WeightsReady

Event = dict[str, Any]

# processes (Perfetto's groups of tracks), in the order they are drawn
PID_SAMPLES, PID_ENGINES, PID_BUFFER, PID_TRAINER, PID_SYNC, PID_DLQ = 1, 2, 3, 4, 5, 6
PROCESS_NAMES = {
    PID_SAMPLES: "samples (dispatch -> trained)",
    PID_ENGINES: "rollout: engines",
    PID_BUFFER: "buffer",
    PID_TRAINER: "trainer",
    PID_SYNC: "sync",
    PID_DLQ: "dead letters",
}


@dataclass
class Records:
    """What a run recorded, as decoded messages (any order)."""

    run: str
    groups: list[SampleGroup] = field(default_factory=list)
    batches: list[TrainBatch] = field(default_factory=list)
    published: list[WeightsPublished] = field(default_factory=list)
    ready: list[WeightsReady] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    undecodable: int = 0  # messages read that did not decode (left out of the timeline)


@dataclass(frozen=True)
class Slice:
    """One "X" event before it has a thread: [start, end) in unix seconds."""

    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)
    children: tuple[Slice, ...] = ()  # nested inside it, on its thread


def _us(t: float, t0: float) -> float:
    # microseconds, rounded to 0.1 us: enough for any message time and a smaller file
    return round((t - t0) * 1e6, 1)


def _meta(name: str, pid: int, tid: int | None, value: str) -> Event:
    ev: Event = {"ph": "M", "name": name, "pid": pid, "args": {"name": value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def pack_lanes(slices: Iterable[Slice]) -> list[list[Slice]]:
    """Slices in lanes such that those of one lane are disjoint (greedy, by start): the
    fewest lanes any packing can have (interval partitioning)."""
    lanes: list[list[Slice]] = []
    free: list[tuple[float, int]] = []  # (end of the lane's last slice, lane)
    for s in sorted(slices, key=lambda s: (s.start, s.end)):
        if free and free[0][0] <= s.start:
            _, lane = heapq.heappop(free)
        else:
            lane = len(lanes)
            lanes.append([])
        lanes[lane].append(s)
        heapq.heappush(free, (s.end, lane))
    return lanes


class _Tracks:
    """Allocates thread ids per process and names them; turns slices into events."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.events: list[Event] = []
        self._next_tid: dict[int, int] = defaultdict(lambda: 1)
        self._named: dict[tuple[int, str], int] = {}

    def thread(self, pid: int, name: str) -> int:
        key = (pid, name)
        if key not in self._named:
            tid = self._next_tid[pid]
            self._next_tid[pid] += 1
            self._named[key] = tid
            self.events.append(_meta("thread_name", pid, tid, name))
            self.events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                                "args": {"sort_index": tid}})  # fmt: skip
        return self._named[key]

    def lanes(self, pid: int, track: str, slices: Iterable[Slice], cat: str) -> None:
        """`slices` of one track, packed into lanes named `track` (and `#k` past the first)."""
        for k, lane in enumerate(pack_lanes(slices)):
            tid = self.thread(pid, track if k == 0 else f"{track} #{k + 1}")
            for s in lane:
                self.slice(pid, tid, s, cat)

    def slice(self, pid: int, tid: int, s: Slice, cat: str) -> None:
        ts = _us(s.start, self.t0)
        dur = max(0.0, round(_us(s.end, self.t0) - ts, 1))
        ev: Event = {"ph": "X", "name": s.name, "cat": cat, "ts": ts, "dur": dur,
                     "pid": pid, "tid": tid}  # fmt: skip
        if s.args:
            ev["args"] = s.args
        self.events.append(ev)
        for c in s.children:
            self.slice(pid, tid, c, cat)

    def instant(self, pid: int, tid: int, name: str, t: float, cat: str,
                args: dict[str, Any], scope: str = "t") -> None:  # fmt: skip
        self.events.append({"ph": "i", "name": name, "cat": cat, "ts": _us(t, self.t0),
                            "pid": pid, "tid": tid, "s": scope, "args": args})  # fmt: skip


def _t0(rec: Records) -> float:
    times = [s.queued_at or s.started_at for g in rec.groups for s in g.samples]
    times += [g.created_at for g in rec.groups] + [b.created_at for b in rec.batches]
    times += [w.published_at for w in rec.published] + [w.ready_at for w in rec.ready]
    times += [d.at for d in rec.dead]
    known = [t for t in times if t > 0]
    return min(known) if known else 0.0


def _first_batch(batches: Sequence[TrainBatch]) -> dict[str, TrainBatch]:
    """group id -> the first batch that carried it (a re-published batch counts once)."""
    out: dict[str, TrainBatch] = {}
    for b in sorted(batches, key=lambda b: (b.step, b.created_at)):
        for g in b.groups:
            out.setdefault(g.group_id, b)
    return out


def _step_ends(published: Sequence[WeightsPublished]) -> tuple[list[int], list[float]]:
    """(steps done, published_at) of the versions, by steps done: the first publish that
    counts a step ends it (a trainer may publish every k steps)."""
    firsts: dict[int, float] = {}
    for w in published:
        if w.published_at > 0:
            firsts[w.step] = min(firsts.get(w.step, w.published_at), w.published_at)
    steps = sorted(firsts)
    return steps, [firsts[s] for s in steps]


def _trained_at(step: int, steps: list[int], ends: list[float]) -> float | None:
    """When the batch of `step` (0-based) was trained: the first version published after
    it (WeightsPublished.step counts the steps done, so batch k is in step k + 1's)."""
    import bisect

    i = bisect.bisect_left(steps, step + 1)
    return ends[i] if i < len(steps) else None


def _sample_slices(
    rec: Records, carried: dict[str, TrainBatch], steps: list[int], ends: list[float]
) -> tuple[list[Slice], dict[str, list[Slice]], list[Slice]]:
    """(a life slice per sample, generation slices per engine track, buffered per group)."""
    lives: list[Slice] = []
    per_engine: dict[str, list[Slice]] = defaultdict(list)
    buffered: list[Slice] = []
    for g in rec.groups:
        batch = carried.get(g.group_id)
        batch_at = batch.created_at if batch is not None and batch.created_at > 0 else None
        trained_at = _trained_at(batch.step, steps, ends) if batch is not None else None
        if batch_at is not None and g.created_at > 0:
            buffered.append(Slice(g.group_id, g.created_at, batch_at,
                                  {"group": g.group_id, "step": batch.step if batch else None,
                                   "samples": len(g.samples)}))  # fmt: skip
        for s in g.samples:
            start = s.queued_at or s.started_at or g.created_at
            end = max(t for t in (trained_at, batch_at, g.created_at, s.finished_at, start) if t)
            args: dict[str, Any] = {
                "sample": s.sample_id, "task": s.task_id, "worker": g.worker_id,
                "engine": s.engine_id, "weight_version": s.weight_version,
                "weight_version_last": s.weight_version_last, "reward": s.reward,
                "response_tokens": len(s.response_ids) // 4,
                "step": batch.step if batch else None,
                "batch": batch.batch_id if batch else None,
            }  # fmt: skip
            parts = []
            if s.queued_at and s.started_at:
                parts.append(Slice("queued", s.queued_at, s.started_at))
            if s.started_at and s.finished_at:
                gen = Slice(f"generate+score {s.sample_id}", s.started_at, s.finished_at, args)
                per_engine[f"{s.engine_id} (worker {g.worker_id})"].append(gen)
                parts.append(Slice("generate+score", s.started_at, s.finished_at))
            if s.finished_at and g.created_at > s.finished_at:
                parts.append(Slice("group", s.finished_at, g.created_at))
            if batch is not None and batch_at is not None and g.created_at:
                parts.append(Slice("buffered", g.created_at, batch_at))
                if trained_at is not None and trained_at >= batch_at:
                    parts.append(Slice(f"train step {batch.step}", batch_at, trained_at))
            lives.append(Slice(s.sample_id, start, end, args, _nested(parts, start, end)))
    return lives, per_engine, buffered


def _nested(parts: list[Slice], start: float, end: float) -> tuple[Slice, ...]:
    """Parts clipped into [start, end] and to each other, so they nest without overlap."""
    out: list[Slice] = []
    at = start
    for p in sorted(parts, key=lambda p: p.start):
        s, e = max(p.start, at, start), min(p.end, end)
        if e > s:
            out.append(Slice(p.name, s, e, p.args))
            at = e
    return tuple(out)


def _train_steps(rec: Records, steps: list[int], ends: list[float]) -> list[Slice]:
    """A slice per step: from when its batch existed and the step before had published, to
    the first publish that counts it (module doc)."""
    out: list[Slice] = []
    prev_end = 0.0
    for b in sorted({b.step: b for b in reversed(rec.batches)}.values(), key=lambda b: b.step):
        end = _trained_at(b.step, steps, ends)
        if end is None or b.created_at <= 0:
            continue
        start = max(b.created_at, prev_end)
        if end > start:
            out.append(Slice(f"step {b.step}", start, end,
                             {"batch": b.batch_id, "groups": len(b.groups),
                              "samples": sum(len(g.samples) for g in b.groups)}))  # fmt: skip
            prev_end = end
    return out


def trace_events(rec: Records) -> list[Event]:
    """The run's Chrome trace events (module doc): metadata, slices, instants."""
    t0 = _t0(rec)
    tr = _Tracks(t0)
    for pid, name in PROCESS_NAMES.items():
        tr.events.append(_meta("process_name", pid, None, name))
        tr.events.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                          "args": {"sort_index": pid}})  # fmt: skip
    carried = _first_batch(rec.batches)
    steps, ends = _step_ends(rec.published)
    lives, per_engine, buffered = _sample_slices(rec, carried, steps, ends)
    tr.lanes(PID_SAMPLES, "samples", lives, "sample")
    for track in sorted(per_engine):
        tr.lanes(PID_ENGINES, track, per_engine[track], "generate")
    tr.lanes(PID_BUFFER, "groups buffered", buffered, "buffer")
    batches_tid = tr.thread(PID_BUFFER, "batches")
    for b in rec.batches:
        if b.created_at > 0:
            tr.instant(PID_BUFFER, batches_tid, f"batch step {b.step}", b.created_at, "batch",
                       {"batch": b.batch_id, "groups": len(b.groups)})  # fmt: skip
    tr.lanes(PID_TRAINER, "steps", _train_steps(rec, steps, ends), "train")
    _versions(rec, tr)
    _dead_letters(rec, tr)
    return tr.events


def _versions(rec: Records, tr: _Tracks) -> None:
    """Published and ready as global markers; sync's load of each version as a slice."""
    pub_tid = tr.thread(PID_TRAINER, "weights published")
    ready_tid = tr.thread(PID_SYNC, "weights ready")
    published: dict[int, float] = {}
    for w in rec.published:
        if w.published_at > 0:
            published.setdefault(w.version, w.published_at)
            args = {"version": w.version, "step": w.step, "size_bytes": w.size_bytes,
                    "uri": w.uri}  # fmt: skip
            name = f"v{w.version} published"
            tr.instant(PID_TRAINER, pub_tid, name, w.published_at, "weights", args, scope="g")
    loads: list[Slice] = []
    for r in rec.ready:
        if r.ready_at <= 0:
            continue
        tr.instant(PID_SYNC, ready_tid, f"v{r.version} ready", r.ready_at, "weights",
                   {"version": r.version, "engines": list(r.engines)}, scope="g")  # fmt: skip
        at = published.get(r.version)
        if at is not None and r.ready_at >= at:
            loads.append(Slice(f"load v{r.version}", at, r.ready_at,
                               {"version": r.version, "engines": list(r.engines)}))  # fmt: skip
    tr.lanes(PID_SYNC, "engines loading", loads, "weights")


def _dead_letters(rec: Records, tr: _Tracks) -> None:
    for d in rec.dead:
        if d.at <= 0:
            continue
        tid = tr.thread(PID_DLQ, d.service)
        tr.instant(PID_DLQ, tid, f"dead letter: {d.reason}", d.at, "dlq",
                   {"reason": d.reason, "error": d.error[:500], "subject": d.subject,
                    "message_type": d.message_type, "delivered": d.delivered})  # fmt: skip


def trace_document(rec: Records) -> dict[str, Any]:
    """The whole JSON object: `traceEvents` and what they count (`otherData`)."""
    events = trace_events(rec)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "run": rec.run,
            "t0_unix": _t0(rec),
            "sample_groups": len(rec.groups),
            "samples": sum(len(g.samples) for g in rec.groups),
            "batches": len(rec.batches),
            "versions_published": len(rec.published),
            "versions_ready": len(rec.ready),
            "dead_letters": len(rec.dead),
            "undecodable": rec.undecodable,
        },
    }

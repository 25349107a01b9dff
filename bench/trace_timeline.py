"""`flywheel trace`: seconds and MB, on a recorded run and on a synthetic 100k-sample one.

    .venv/bin/python bench/trace_timeline.py --config RUN.toml   # a recorded run
    .venv/bin/python bench/trace_timeline.py --config RUN.toml --split  # its parts apart
    .venv/bin/python bench/trace_timeline.py --synthetic 100000  # core + JSON
    .venv/bin/python bench/trace_timeline.py --render TRACE.json --png OUT.png  # a picture

--render draws a trace file as a simple Gantt chart with matplotlib: one row
per track (thread), its "X" slices as bars, "i" instants as ticks, version
markers as vertical lines. It is a rendering of the same JSON for docs, not
a Perfetto screenshot (these machines have no browser).

--config runs `flywheel trace -c RUN.toml -o <tmp>` as a subprocess (reading the
streams included: a stopped run's store is opened by a nats-server of its own)
and reports its wall seconds, the file's MB and what it holds.

--synthetic builds the records of a run of N samples in memory (groups of 8
on 4 engines, 32 groups a step, a version published and made ready each
step, a dead letter every 1,000 groups), with the times a run records, and
times services/replay/timeline.py's conversion and the JSON writing
separately (building the records is not timed: a real run reads them from
NATS, which --config measures). Peak RSS is the process's, records included.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_GROUP, GROUPS_PER_STEP, ENGINES = 8, 32, 4


def synthetic(samples: int):  # -> Records
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
    from services.replay.timeline import Records

    t0, run = 1_700_000_000.0, "bench"
    rec = Records(run)
    ids, lps, mask = pack_i32(range(16)), pack_f32([-0.5] * 16), pack_u8([1] * 16)
    step_s, gen_s = 2.0, 1.5  # a step every 2 s; a group generates in 1.5 s
    per_step: list[SampleGroup] = []
    for gi in range(samples // N_GROUP):
        step = gi // GROUPS_PER_STEP
        eng = f"engine-{gi % ENGINES}"
        queued = t0 + step * step_s + (gi % GROUPS_PER_STEP) * 0.01
        started = queued + 0.2
        gid = f"{run}:e0:i{gi}:a0"
        ss = tuple(
            Sample(sample_id=f"{gid}:s{i}", group_id=gid, task_id=gid, index=i, prompt_ids=ids,
                   response_ids=ids, logprobs=lps, loss_mask=mask, reward=float(i % 2),
                   finish_reason=FinishReason.STOP, weight_version=max(0, step - 1),
                   weight_version_last=max(0, step - 1), engine_id=eng, queued_at=queued,
                   started_at=started, finished_at=started + gen_s * (0.5 + i / 16))
            for i in range(N_GROUP)
        )  # fmt: skip
        g = SampleGroup(run=run, group_id=gid, task_id=gid, env="arith",
                        worker_id=f"rollout-{gi % ENGINES}", samples=ss,
                        created_at=started + gen_s)  # fmt: skip
        rec.groups.append(g)
        per_step.append(g)
        if len(per_step) == GROUPS_PER_STEP:
            at = g.created_at + 0.05
            rec.batches.append(TrainBatch(run=run, batch_id=f"b{step}", step=step,
                                          groups=tuple(per_step), created_at=at))  # fmt: skip
            rec.published.append(WeightsPublished(
                run=run, version=step + 1, step=step + 1, uri=f"file:///w/v{step + 1}",
                sha256="0" * 64, size_bytes=1, published_at=at + step_s))  # fmt: skip
            rec.ready.append(WeightsReady(run=run, version=step + 1, ready_at=at + step_s + 0.3))
            per_step = []
        if gi % 1000 == 999:
            rec.dead.append(DeadLetter(run=run, reason="stale", error="older than the bound",
                                       subject="s", payload=b"", service="buffer",
                                       at=queued + 1.0))  # fmt: skip
    return rec


def bench_synthetic(samples: int) -> dict:
    from services.replay.timeline import trace_document
    from services.replay.trace import write

    rec = synthetic(samples)
    t = time.perf_counter()
    doc = trace_document(rec)
    convert_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "trace.json"
        t = time.perf_counter()
        write(doc, out)
        write_s = time.perf_counter() - t
        mb = out.stat().st_size / 1e6
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {"samples": samples, "events": len(doc["traceEvents"]),
            "convert_s": round(convert_s, 2), "write_s": round(write_s, 2),
            "total_s": round(convert_s + write_s, 2), "mb": round(mb, 1),
            "peak_rss_mb": round(rss_mb)}  # fmt: skip


def bench_config(config: Path) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "trace.json"
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "services", "trace", "-c", str(config), "-o",
                            str(out)], capture_output=True, text=True, cwd=os.getcwd())  # fmt: skip
        wall = time.perf_counter() - t
        if p.returncode != 0:
            raise SystemExit(p.stdout + p.stderr)
        doc = json.loads(out.read_text())
        return {"config": str(config), "wall_s": round(wall, 2),
                "mb": round(out.stat().st_size / 1e6, 2), "events": len(doc["traceEvents"]),
                **doc["otherData"], "said": p.stdout.strip()}  # fmt: skip


COLOURS = {"queued": "#bbbbbb", "generate+score": "#4c72b0", "group": "#8172b2",
           "buffered": "#dd8452", "sample": "#e8e8e8", "generate": "#4c72b0",
           "buffer": "#dd8452", "train": "#55a868", "weights": "#c44e52"}  # fmt: skip


def render(trace: Path, png: Path, window: tuple[float, float] | None = None,
           per_process: int = 10) -> None:  # fmt: skip
    """The trace as a Gantt chart (module doc): the events within `window` (seconds from the
    run's first record; None: all), the first `per_process` rows (threads) of each process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(trace.read_text())
    ev = doc["traceEvents"]
    if window is not None:  # what overlaps the window, metadata kept
        lo, hi = window[0] * 1e6, window[1] * 1e6
        ev = [
            e for e in ev if e["ph"] == "M" or (lo <= e["ts"] + e.get("dur", 0) and e["ts"] <= hi)
        ]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in ev if e["ph"] in ("X", "i")}
    rows = [k for k in sorted(threads) if k in used]
    rows = [k for k in rows if sum(1 for r in rows if r[0] == k[0] and r[1] < k[1]) < per_process]
    y = {k: i for i, k in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(13, 0.32 * len(rows) + 1.6))
    for e in ev:
        k = (e.get("pid"), e.get("tid"))
        if e["ph"] == "X" and k in y:
            # a sample's phases over its life slice: the life a pale bar, phases thinner
            life = e["name"] == e.get("args", {}).get("sample")
            colour = COLOURS["sample"] if life else COLOURS.get(e["name"], COLOURS[e["cat"]])
            h = 0.8 if life or e["cat"] != "sample" else 0.5
            ax.barh(y[k], e["dur"] / 1e6, left=e["ts"] / 1e6, height=h, color=colour,
                    edgecolor="white", linewidth=0.3)  # fmt: skip
        elif e["ph"] == "i" and e.get("s") == "g":
            ax.axvline(e["ts"] / 1e6, color=COLOURS["weights"], lw=0.6, alpha=0.35)
        elif e["ph"] == "i" and k in y:
            ax.plot(e["ts"] / 1e6, y[k], marker="v", color="black", ms=5)
    ax.set_yticks(range(len(rows)), [f"{procs[p].split(' (')[0]}: {threads[(p, t)]}"
                                     for p, t in rows], fontsize=7)  # fmt: skip
    ax.invert_yaxis()
    if window is not None:
        ax.set_xlim(*window)
    ax.set_xlabel("seconds since the run's first record")
    o = doc["otherData"]
    ax.set_title(f"flywheel trace of run {o['run']!r}: {o['samples']} samples, {o['batches']} "
                 f"batches, {o['versions_published']} versions (vertical lines: published / "
                 "ready)", fontsize=9)  # fmt: skip
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[n]) for n in
               ("queued", "generate+score", "buffered", "train", "sample")]  # fmt: skip
    ax.legend(handles, ["queued", "generate+score", "buffered", "train step", "sample's life"],
              fontsize=7, loc="upper left")  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def bench_split(config: Path) -> dict:
    """`flywheel trace`'s three parts timed apart, in this process: read, convert, write."""
    import asyncio

    from services.replay.source import Hooks, nats_url, recorded_run
    from services.replay.timeline import trace_document
    from services.replay.trace import read_records, write
    from services.stack.replaying import open_store

    rec = recorded_run(config)
    with nats_url(rec, None, Hooks(open_store=open_store)) as url:
        t = time.perf_counter()
        records = asyncio.run(read_records(rec, url))
        read_s = time.perf_counter() - t
    t = time.perf_counter()
    doc = trace_document(records)
    convert_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        write(doc, Path(d) / "trace.json")
        write_s = time.perf_counter() - t
    return {"config": str(config), "read_s": round(read_s, 1), "convert_s": round(convert_s, 1),
            "write_s": round(write_s, 1)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, help="a recorded run's run file")
    p.add_argument("--synthetic", type=int, help="samples of a synthetic run")
    p.add_argument("--split", action="store_true", help="--config: time read/convert/write")
    p.add_argument("--render", type=Path, help="a trace file to draw (with --png)")
    p.add_argument("--png", type=Path, help="where --render writes its picture")
    p.add_argument("--window", type=float, nargs=2, metavar=("FROM", "TO"),
                   help="--render only these seconds of the run")  # fmt: skip
    a = p.parse_args()
    if a.render:
        render(a.render, a.png or a.render.with_suffix(".png"), a.window)
    if a.config:
        print(json.dumps(bench_split(a.config) if a.split else bench_config(a.config)))
    if a.synthetic:
        print(json.dumps(bench_synthetic(a.synthetic)))


if __name__ == "__main__":
    main()

"""Where a synchronous (k=0) step's time goes, from what a demo run leaves behind.

    .venv/bin/python bench/e2e.py --profile [--seconds 90]   # runs k=0, then this
    .venv/bin/python bench/step_profile.py RUN_DIR [--run demo]   # an existing run dir
    .venv/bin/python bench/step_profile.py RUN_DIR --waste        # stale share of generation

No new instrumentation on the message path: every message already carries
its timestamps (a sample's `queued_at` = the task's dispatch, `started_at`,
`finished_at`; a group's and a batch's `created_at`; `published_at` of a
weight version, `ready_at` once every engine serves it), and the trainer's
metrics rows carry `received_at`, `compute_s` and the compute stages
(`time_encode_s`, `time_prepare_s`, `time_logprobs_s`,
`time_forward_backward_s`, `time_optimizer_s`: services/trainer/stopwatch.py).
The BATCHES and WEIGHTS streams keep their history, so after the run they
are read back from the run's NATS store (a nats-server started on it).

At k = 0 step s waits for everything before it, so the period between the
ends of steps s - 1 and s is exactly the sum of the critical path's stages:

    trainer end s-1 → weights published v=s      save + announce
    published → ready                             sync: every engine loads v=s
    ready → first task of batch s dispatched      buffer admission
    first dispatch → last group published         generation of the batch (its tail)
    last group → batch published                  NATS hop + buffer assembly
    batch published → trainer received            NATS hop + trainer read
    trainer received → step end                   encode, prepare, logprobs, fwd/bwd, optimizer

Per group, the batch's generation splits into dispatch → generation start
(the task's NATS hop, worker, engine version check) and generation start →
last sample scored (engine + verifier; exact_match's verifier is µs).
Clocks: all processes share one machine's clock (time.time()).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CRITICAL = [
    ("save", "weights save + announce (trainer)"),
    ("sync", "published → ready on every engine (sync, engine load)"),
    ("admit", "ready → first task dispatched (buffer)"),
    ("generate_tail", "first dispatch → last group published (batch generation)"),
    ("assemble", "last group → batch published (NATS, buffer)"),
    ("batch_hop", "batch published → trainer received (NATS, trainer read)"),
    ("time_encode_s", "trainer: wire batch → tensors"),
    ("time_prepare_s", "trainer: advantages, layout, micro-batches"),
    ("time_logprobs_s", "trainer: logprob recompute (no grad)"),
    ("time_forward_backward_s", "trainer: forward + backward"),
    ("time_optimizer_s", "trainer: clip + optimizer step"),
]
DETAIL = [
    ("task_hop", "per group: dispatch → generation start (NATS, worker)"),
    ("generate", "per group: generation start → last sample scored (engine, verifier)"),
    ("publish_s", "trainer: weights directory + checkpoint written (inside save + announce)"),
]


@dataclass
class Weights:
    published_at: dict[int, float]
    ready_at: dict[int, float]


def step_stages(
    row: dict[str, Any], prev: dict[str, Any], batch: Any, w: Weights
) -> dict[str, float] | None:
    """The stages of step `row["step"]` (batch s = step - 1 trains on version s), or None
    when a timestamp is missing (the first step, a version without a ready message)."""
    s = row["step"] - 1
    if s < 1 or s not in w.published_at or s not in w.ready_at or "received_at" not in prev:
        return None
    prev_end = prev["received_at"] + prev["compute_s"]
    samples = [x for g in batch.groups for x in g.samples]
    first_dispatch = min(x.queued_at for x in samples)
    last_group = max(g.created_at for g in batch.groups)
    out = {
        "save": w.published_at[s] - prev_end,
        "sync": w.ready_at[s] - w.published_at[s],
        "admit": first_dispatch - w.ready_at[s],
        "generate_tail": last_group - first_dispatch,
        "assemble": batch.created_at - last_group,
        "batch_hop": row["received_at"] - batch.created_at,
        "period": row["received_at"] + row["compute_s"] - prev_end,
        "compute": row["compute_s"],
    }
    out |= {k: row.get(k, 0.0) for k, _ in CRITICAL if k.startswith("time_")}
    # The step's own save (from its snapshot) is recorded in its own row: the row of
    # step s carries the publish of version s, which is on the path of step s + 1.
    out["publish_s"] = prev.get("publish_s", 0.0)
    per_group = [
        (min(x.started_at for x in g.samples) - min(x.queued_at for x in g.samples),
         max(x.finished_at for x in g.samples) - min(x.started_at for x in g.samples))
        for g in batch.groups
    ]  # fmt: skip
    out["task_hop"] = statistics.median(h for h, _ in per_group)
    out["generate"] = statistics.median(d for _, d in per_group)
    return out


def breakdown(rows: list[dict[str, Any]], batches: dict[int, Any], w: Weights) -> dict[str, Any]:
    """Median of every stage over the run's steps, and how the critical path adds up."""
    steps = {r["step"]: r for r in rows if "compute_s" in r}
    per_step = []
    for n, row in sorted(steps.items()):
        prev = steps.get(n - 1)
        if prev is not None and n - 1 in batches:
            st = step_stages(row, prev, batches[n - 1], w)
            if st is not None:
                per_step.append(st)
    if not per_step:
        return {"steps": 0}
    med = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
    return {"steps": len(per_step), "median": med}


def table(b: dict[str, Any]) -> str:
    if not b.get("steps"):
        return "No complete steps to profile (need k=0 steps with received_at in the rows).\n"
    med = b["median"]
    period = med["period"]
    lines = [f"Median over {b['steps']} steps; step period {period * 1000:.0f} ms.", "",
             "| stage (critical path, in order) | median ms | share of period |",
             "|---|---|---|"]  # fmt: skip
    for k, label in CRITICAL:
        lines.append(f"| {label} | {med[k] * 1000:.1f} | {med[k] / period:.0%} |")
    summed = sum(med[k] for k, _ in CRITICAL)
    lines.append(f"| *sum of the medians* | {summed * 1000:.1f} | {summed / period:.0%} |")
    for k, label in DETAIL:
        lines.append(f"| {label} | {med[k] * 1000:.1f} | (inside generation) |")
    return "\n".join(lines) + "\n"


async def read_streams(store: Path, run: str) -> tuple[dict[int, Any], Weights]:
    """Batches by step and the weights' timestamps, read back from the run's NATS store."""
    import nats

    from proto.chunking import Reassembler
    from proto.codec import decode_any
    from proto.messages import TrainBatch, WeightsPublished, WeightsReady
    from proto.streams import stream_name
    from services.stack.localdev.nats_cluster import embedded_nats

    server = embedded_nats(1, store_dir=store).start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        batches: dict[int, Any] = {}
        w = Weights({}, {})
        joiner = Reassembler()
        for what in ("BATCHES", "WEIGHTS"):
            name = stream_name(run, what)
            info = await js.stream_info(name)
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                whole = joiner.feed((await js.get_msg(name, seq)).data or b"")
                msg = decode_any(whole) if whole is not None else None
                if isinstance(msg, TrainBatch):
                    batches[msg.step] = msg
                elif isinstance(msg, WeightsPublished):
                    w.published_at.setdefault(msg.version, msg.published_at)
                elif isinstance(msg, WeightsReady):
                    w.ready_at.setdefault(msg.version, msg.ready_at)
        await nc.close()
    finally:
        server.close()
    return batches, w


async def waste(store: Path, run: str) -> dict[str, float]:
    """Groups generated (SAMPLES) and dead-lettered by reason (DLQ), from the run's store:
    the stale share of generation, whichever buffer version made the run."""
    import nats

    from proto.codec import decode
    from proto.messages import DeadLetter, SampleGroup
    from proto.streams import stream_name
    from services.stack.localdev.nats_cluster import embedded_nats

    server = embedded_nats(1, store_dir=store).start()
    out: dict[str, float] = {"generated": 0, "generated_tokens": 0}
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        for what in ("SAMPLES", "DLQ"):
            name = stream_name(run, what)
            info = await js.stream_info(name)
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                data = (await js.get_msg(name, seq)).data or b""
                if what == "SAMPLES":
                    g = decode(data, SampleGroup)
                    tokens = sum(x.num_response_tokens for x in g.samples)
                    out["generated"] += 1
                    out["generated_tokens"] += tokens
                    continue
                dl = decode(data, DeadLetter)
                out[dl.reason] = out.get(dl.reason, 0) + 1
                if dl.message_type == SampleGroup.TYPE:
                    g = decode(dl.payload, SampleGroup)
                    key = f"{dl.reason}_tokens"
                    out[key] = out.get(key, 0) + sum(x.num_response_tokens for x in g.samples)
        await nc.close()
    finally:
        server.close()
    return out


def waste_line(w: dict[str, float]) -> str:
    gen, stale = w["generated"], w.get("stale", 0)
    zv = w.get("zero_variance", 0)
    return (
        f"generated {gen:.0f} groups ({w['generated_tokens']:.0f} response tokens); "
        f"stale {stale:.0f} ({stale / max(gen, 1):.1%} of groups, "
        f"{w.get('stale_tokens', 0) / max(w['generated_tokens'], 1):.1%} of tokens); "
        f"zero-variance {zv:.0f} ({zv / max(gen, 1):.1%})"
    )


def breakdown_of(run_dir: Path, run: str) -> dict[str, Any]:
    """The breakdown of the run a run directory holds (its metrics file and NATS store)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    batches, w = asyncio.run(read_streams(run_dir / "nats", run))
    return breakdown(rows, batches, w)


def profile(run_dir: Path, run: str) -> str:
    return table(breakdown_of(run_dir, run))


def compare_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Several runs' medians side by side (ms), with each run's ratio to the first."""
    done = [(label, b["median"]) for label, b in runs if b.get("steps")]
    if not done:
        return "No run has complete steps to profile.\n"
    base = done[0][1]
    head = "| stage | " + " | ".join(f"{label} ms" for label, _ in done)
    head += "".join(f" | {label} / {done[0][0]}" for label, _ in done[1:]) + " |"
    lines = [head, "|---" * (1 + len(done) + len(done) - 1) + "|"]
    keys = [("period", "**step period**"), *CRITICAL, *DETAIL]
    for k, label in keys:
        vals = [m.get(k, 0.0) for _, m in done]
        cells = " | ".join(f"{v * 1000:.0f}" for v in vals)
        ratios = "".join(f" | {v / base[k]:.2f}x" if base.get(k) else " | -" for v in vals[1:])
        lines.append(f"| {label} | {cells}{ratios} |")
    steps = ", ".join(f"{label}: {b['steps']}" for label, b in runs)
    return "\n".join(lines) + f"\n\nSteps profiled (medians over them): {steps}.\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--run", default="demo", help="the run's name (its streams' names)")
    p.add_argument("--waste", action="store_true", help="only the stale share of generation")
    args = p.parse_args(argv)
    if args.waste:
        print(waste_line(asyncio.run(waste(args.run_dir / "nats", args.run))))
        return 0
    print(profile(args.run_dir, args.run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

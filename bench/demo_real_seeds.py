"""`make demo-real` under N seeds, back to back: does it learn every time? (issue #35, item 2)

    .venv/bin/python bench/demo_real_seeds.py                  # seeds 0-7, the demo's defaults
    .venv/bin/python bench/demo_real_seeds.py --seeds 3 --out-dir runs/seeds-smoke \
        -- --rl-steps 2                                        # smoke: 1 seed, 2 RL steps
    .venv/bin/python bench/demo_real_seeds.py -- -c my-run.toml  # any demo flags after `--`

Each seed is one `flywheel demo --task real --seed S --run-dir DIR/seed-S --quiet`
in a subprocess (a fresh run directory: the demo empties it), one after the
other, never two at once. `--seed` sets the RL run's seeds: the buffer's prompt
shuffle, the engine's sampler and the trainer's torch RNG
(services/stack/demo.py `with_seed`); the task, the model and every other key
are the run file's.

One row per run, to DIR/seeds.md (a markdown table, pasted into
bench/results_learning.md) and DIR/seeds.json (every figure, and each run's
validation curve):

- steps, RL seconds, test before → after: the demo's summary.json (test
  pass@1 on `--eval-size` held-out lists, the weights chosen on validation);
- end to end: wall seconds of the whole `flywheel demo` process (model
  check, the before-evaluation, RL, the after-evaluation, the plot);
- learned: after ≥ `--bar` (0.7) and end to end ≤ `--budget-s` (720 s),
  the issue's bar;
- flat: the status lines' `flat` share (the buffer's last step's flat
  groups), mean and max over the run; stalls: the buffer's one-line "no
  trainable group in the last ..." messages seen in the run's logs;
- eval share: what held-out evaluations cost the training, over the RL
  seconds. Evaluations beside the loop (rows with `eval_s`): the excess of
  the steps trained while one ran over the median step trained while none
  ran, summed (`beside_share`; the evaluation's own seconds are not a
  stall). Evaluations in the loop (older runs, no `eval_s`): the excess of
  the rows' gap at an evaluated step over the median gap of the other
  steps, summed. Both leave the step-0 evaluation out (`—` under 4 steps).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLAT = re.compile(r"\| flat (\d+)%")
STALL = "no trainable group in the last"


@dataclass
class SeedRun:
    seed: int
    code: int = 0
    steps: int | None = None
    best_step: int | None = None
    rl_s: float | None = None
    end_to_end_s: float = 0.0
    before: float | None = None
    after: float | None = None
    learned: bool = False
    flat_mean: float | None = None
    flat_max: float | None = None
    stalls: int = 0
    eval_share: float | None = None
    load: tuple[float, float] = (0.0, 0.0)
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # step, elapsed, acc
    run_dir: str = ""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def flat_shares(status_log: Path) -> list[float]:
    """The `flat` share of every status line that shows one (0-1)."""
    if not status_log.is_file():
        return []
    return [int(m.group(1)) / 100 for m in map(FLAT.search, status_log.read_text().splitlines())
            if m]  # fmt: skip


def stall_lines(run_dir: Path, console: Path) -> int:
    """The buffer's stall lines: in its log (with --quiet), else on the console."""
    logs = sorted((run_dir / "logs").glob("buffer*.log")) if (run_dir / "logs").is_dir() else []
    texts = [p.read_text(errors="replace") for p in logs] or [console.read_text(errors="replace")]
    return sum(t.count(STALL) for t in texts)


def eval_share(rows: list[dict[str, Any]]) -> float | None:
    """Share of RL wall time that held-out evaluations cost the training (module doc)."""
    steps = [r for r in rows if "elapsed" in r]
    if not steps or steps[-1]["elapsed"] <= 0:
        return None
    if any("eval_s" in r for r in steps):
        return beside_share(rows)
    if len(steps) < 4:
        return None  # too few steps to tell a typical gap
    # the first gap holds start-up and the first batch's wait besides the step-0 evaluation
    gaps = [(b, b["elapsed"] - a["elapsed"]) for a, b in itertools.pairwise(steps[1:])]
    plain = [g for r, g in gaps if "eval_accuracy" not in r]
    if not plain:
        return None
    typical = statistics.median(plain)
    extra = sum(max(0.0, g - typical) for r, g in gaps if "eval_accuracy" in r)
    return extra / steps[-1]["elapsed"]


def beside_share(rows: list[dict[str, Any]]) -> float | None:
    """Evaluations beside the loop (rows with `eval_s`): how much longer the steps trained
    while one ran took than the median step trained while none ran, summed, over the
    RL wall time from the first trained step to the last. An evaluation's seconds are
    not the loop's: the loop goes on training meanwhile; what it costs is the CPU it
    takes from the steps (and the engine) beside it. The step-0 evaluation runs before
    the first step and is left out, as are steps with no timestamp."""
    trained = [r for r in rows if "batch_id" in r and "time" in r]
    # an evaluation's span: its pass@1 row's `eval_s`, or its pass@k row's `eval_k_s` (the
    # whole evaluation, samples included: evaluating.py)
    timed = [(r, r.get("eval_k_s", r.get("eval_s"))) for r in rows if "time" in r]
    timed = [(r, s) for r, s in timed if s is not None]
    windows = [(r["time"] - s, r["time"]) for r, s in timed if r.get("step", 0) > 0]
    first = [(r["time"] - s, r["time"]) for r, s in timed if r.get("step", 0) == 0]
    if len(trained) < 4:
        return None
    gaps = [(a["time"], b["time"]) for a, b in itertools.pairwise(trained)]

    def overlaps(t0: float, t1: float, spans: list[tuple[float, float]]) -> bool:
        return any(t0 < e1 and t1 > e0 for e0, e1 in spans)

    # a gap beside only the step-0 evaluation is neither (the trainer's rule, evalbudget.py)
    beside = [t1 - t0 for t0, t1 in gaps if overlaps(t0, t1, windows)]
    alone = [t1 - t0 for t0, t1 in gaps if not overlaps(t0, t1, windows + first)]
    if len(alone) < 3:  # evalbudget.MIN_ALONE: fewer alone steps cannot tell a typical one
        return None
    typical = statistics.median(alone)
    extra = sum(max(0.0, g - typical) for g in beside)
    return extra / (trained[-1]["time"] - trained[0]["time"])


def run_seed(seed: int, out_dir: Path, demo_args: list[str], bar: float, budget: float) -> SeedRun:
    run_dir = (out_dir / f"seed-{seed}").resolve()
    console = out_dir / f"seed-{seed}.console.log"
    cmd = [sys.executable, "-m", "services", "demo", "--task", "real", "--seed", str(seed),
           "--run-dir", str(run_dir), "--quiet", *demo_args]  # fmt: skip
    print(f"demo_real_seeds: seed {seed}: flywheel {' '.join(cmd[3:])}", flush=True)
    r = SeedRun(seed, run_dir=str(run_dir))
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    with console.open("w") as f:
        r.code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    r.end_to_end_s = time.monotonic() - t0
    r.load = (load0, os.getloadavg()[0])
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        r.steps, r.best_step, r.rl_s = s["rl_steps"], s["best_step"], s["rl_seconds"]
        r.before, r.after = s["accuracy_before"], s["accuracy_after"]
    r.learned = r.after is not None and r.after >= bar and r.end_to_end_s <= budget
    flat = flat_shares(run_dir / "status.log")
    if flat:
        r.flat_mean, r.flat_max = statistics.fmean(flat), max(flat)
    r.stalls = stall_lines(run_dir, console)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    r.eval_share = eval_share(rows)
    r.curve = [(int(x["step"]), round(float(x["elapsed"]), 1), float(x["eval_accuracy"]))
               for x in rows if "eval_accuracy" in x]  # fmt: skip
    print(f"demo_real_seeds: seed {seed}: {row_cells(r)}", flush=True)
    return r


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def row_cells(r: SeedRun) -> str:
    acc = f"{fmt(r.before, '.3f')} → {fmt(r.after, '.3f')}"
    learned = "yes" if r.learned else "no" + (f" (exit {r.code})" if r.code else "")
    flat = f"{fmt(r.flat_mean, '.0%')} / {fmt(r.flat_max, '.0%')}"
    load = f"{r.load[0]:.1f} → {r.load[1]:.1f}"
    return (f"| {r.seed} | {fmt(r.steps, 'd')} | {fmt(r.rl_s, '.0f')} | {r.end_to_end_s:.0f} "
            f"| {acc} | {learned} | {flat} | {r.stalls} | {fmt(r.eval_share, '.1%')} "
            f"| {load} |")  # fmt: skip


def table(runs: list[SeedRun], command: str, bar: float, budget: float) -> str:
    n = sum(r.learned for r in runs)
    head = (
        f"`{command}`\n\n"
        f"**{n} of {len(runs)} learned** "
        f"(test pass@1 ≥ {bar} within {budget:.0f} s end to end).\n\n"
        "| seed | steps | RL s | end to end s | test before → after | learned | "
        "flat mean / max | stall lines | eval share (est.) | load 1-min |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(row_cells(r) for r in runs) + "\n"


def headline(runs: list[SeedRun]) -> str:
    """The README's figure for `make demo-real`: the median and range of the seeds' test
    pass@1 after RL, and of their end-to-end minutes (tests/unit/test_docs.py holds the
    README to the table this bench wrote into bench/results_demo_real.md)."""
    done = [r for r in runs if r.after is not None and r.before is not None]
    before = statistics.median(r.before for r in done if r.before is not None)
    after = [r.after for r in done if r.after is not None]
    minutes = [r.end_to_end_s / 60 for r in done]
    return (
        f"test pass@1 {before:.3f} → {statistics.median(after):.3f} "
        f"(median of {len(done)} seeds, {min(after):.3f}–{max(after):.3f}) in "
        f"{statistics.median(minutes):.1f} min end to end ({min(minutes):.1f}–{max(minutes):.1f})"
    )


def parse_table(md: str) -> list[SeedRun]:
    """The rows `table` wrote (seed, steps, RL s, end to end s, before → after), read back."""
    runs = []
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[0].isdigit():
            continue
        before, _, after = cells[4].partition(" → ")
        runs.append(SeedRun(int(cells[0]), end_to_end_s=float(cells[3]),
                            before=None if before == "—" else float(before),
                            after=None if after == "—" else float(after)))  # fmt: skip
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, demo_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv \
        else (argv, [])  # fmt: skip
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "demo-real-seeds")
    p.add_argument("--bar", type=float, default=0.7, help="test pass@1 a run must reach")
    p.add_argument("--budget-s", type=float, default=720.0, help="end-to-end seconds allowed")
    p.add_argument(
        "--eval-share",
        type=Path,
        nargs="+",
        metavar="METRICS",
        help="only print the evaluation share of these metrics.jsonl files (any run)",
    )
    args = p.parse_args(ours)
    if args.eval_share:
        for path in args.eval_share:
            share = fmt(eval_share(read_jsonl(path)), ".1%")
            print(f"{path}: evaluation share of RL wall time {share}")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    command = "bench/demo_real_seeds.py " + " ".join(argv)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, args.out_dir, demo_args, args.bar, args.budget_s))
        # written after every run: a long series interrupted keeps what it measured
        md = table(runs, command.strip(), args.bar, args.budget_s)
        (args.out_dir / "seeds.md").write_text(md)
        doc = {"command": command.strip(), "bar": args.bar, "budget_s": args.budget_s,
               "demo_args": demo_args, "runs": [asdict(r) for r in runs]}  # fmt: skip
        (args.out_dir / "seeds.json").write_text(json.dumps(doc, indent=2))
    print(md, end="")
    print(f"demo_real_seeds: {headline(runs)}")
    print(f"demo_real_seeds: {args.out_dir / 'seeds.md'}, {args.out_dir / 'seeds.json'}")
    return 0 if all(r.code == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

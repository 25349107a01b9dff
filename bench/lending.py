"""Trainer idle and engine idle with and without the core lease ([stack] placement).

    PYTHONPATH=$PWD .venv/bin/python bench/lending.py -c configs/demo-real.toml \\
        --steps 10 --run-dir /tmp/lending

Runs `flywheel up -c CONFIG --steps N` once per placement (disaggregated, then
colocated, back to back, same run file and seed), each in its own run
directory, with the trainer's held-out evaluations off (`--keep-eval` keeps
them) so the figures are the loop's. Reports, per run: steps, the RL wall
time (the last metrics row's `elapsed`), seconds per step, trained
samples/s, the trainer idle of its last metrics row (`idle_fraction`: time
waiting for a batch over its time since it first asked for one) and the engine
idle of the last status line (the rollout workers' `engine_idle_fraction`:
time with no task in flight since their first task).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

PLACEMENTS = ("disaggregated", "colocated")


def last_status(run_dir: Path) -> str:
    lines = (run_dir / "status.log").read_text().splitlines()
    return lines[-1] if lines else ""


def pct(line: str, what: str) -> str:
    m = re.search(rf"{what} idle (\S+)", line)
    return m.group(1) if m else "-"


def run_one(config: Path, placement: str, steps: int, run_dir: Path, keep_eval: bool) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "FLYWHEEL_STACK_PLACEMENT": placement,
           "FLYWHEEL_STACK_RUN_DIR": str(run_dir)}  # fmt: skip
    if not keep_eval:
        env["FLYWHEEL_TRAINER_EVAL_EVERY"] = "0"
    argv = [sys.executable, "-m", "services.cli", "up", "-c", str(config), "--steps", str(steps)]
    t0 = time.monotonic()
    done = subprocess.run([*argv, "--quiet"], env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{placement}: flywheel up exited {done.returncode}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if "step" in r and "elapsed" in r and "samples" in r]
    line = last_status(run_dir)
    elapsed = rows[-1]["elapsed"]
    return {
        "placement": placement,
        "steps": len(rows),
        "rl_s": elapsed,
        "s_per_step": elapsed / max(len(rows), 1),
        "samples_per_s": sum(r["samples"] for r in rows) / elapsed,
        "trainer_idle": f"{rows[-1]['idle_fraction']:.0%}",
        "engine_idle": pct(line, "engine"),
        "up_s": wall,
        "status": line,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/lending"))
    p.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    p.add_argument("--keep-eval", action="store_true", help="keep the run file's evaluations")
    args = p.parse_args()
    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"started {when}; {os.cpu_count()} CPUs; load 1m {load:.1f}; {args.config}, "
          f"{args.steps} steps")  # fmt: skip
    print("| placement | steps | RL s | s/step | trained samples/s | trainer idle "
          "| engine idle | up s | load 1m after |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for placement in args.placements:
        r = run_one(args.config, placement, args.steps, args.run_dir / placement, args.keep_eval)
        print(f"| {r['placement']} | {r['steps']} | {r['rl_s']:.0f} | {r['s_per_step']:.1f} "
              f"| {r['samples_per_s']:.2f} | {r['trainer_idle']} | {r['engine_idle']} "
              f"| {r['up_s']:.0f} | {os.getloadavg()[0]:.1f} |", flush=True)  # fmt: skip
        print(f"  last status line: {r['status']}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Distillation vs RL from scratch, read from two runs' trainer metrics (no run here).

    .venv/bin/python bench/opd_compare.py --teacher-accuracy 0.9 \
        --rl runs/demo-real/metrics.jsonl --opd runs/distill-real/metrics.jsonl

For each run: the first held-out evaluation (the trainer's validation split,
`eval_accuracy`, every `[trainer] eval_every` steps) within `--margin` (0.05)
of the teacher's accuracy, and what it took to get there: student samples
trained on (the sum of the rows' `samples`) and wall time since the step-0
evaluation (the rows' `time`). Prints one Markdown table; the test split's
figures come from `flywheel eval` on each run's best weights (docs/distillation.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reached(run: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Step, samples, seconds and accuracy at the first evaluation >= target (or the best)."""
    start = next((r["time"] for r in run if r.get("step") == 0 and "time" in r), run[0]["time"])
    samples, best = 0.0, None
    for r in run:
        samples += float(r.get("samples", 0.0)) if "batch_id" in r else 0.0
        if "eval_accuracy" not in r:
            continue
        at = {"step": r["step"], "samples": int(samples), "seconds": r["time"] - start,
              "accuracy": r["eval_accuracy"]}  # fmt: skip
        if r["eval_accuracy"] >= target:
            return {**at, "reached": True}
        if best is None or at["accuracy"] > best["accuracy"]:
            best = at
    return {**(best or {"step": None, "samples": 0, "seconds": 0.0, "accuracy": 0.0}),
            "reached": False}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher-accuracy", type=float, required=True)
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--rl", type=Path, required=True, help="metrics.jsonl of RL from scratch")
    p.add_argument("--opd", type=Path, required=True, help="metrics.jsonl of the distillation")
    a = p.parse_args()
    target = a.teacher_accuracy - a.margin
    print(f"target: validation accuracy >= {target:.3f} (teacher {a.teacher_accuracy:.3f})\n")
    print("| run | reached | step | student samples | wall s | accuracy |")
    print("|---|---|---|---|---|---|")
    for name, path in (("RL from scratch", a.rl), ("distillation", a.opd)):
        r = reached(rows(path), target)
        print(f"| {name} | {'yes' if r['reached'] else 'no (best)'} | {r['step']} | "
              f"{r['samples']} | {r['seconds']:.0f} | {r['accuracy']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()

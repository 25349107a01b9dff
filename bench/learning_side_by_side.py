"""TRL's GRPOTrainer and Flywheel on the same run, back to back, one plot (issue #35, item 4).

    .venv/bin/python bench/learning_side_by_side.py -c configs/demo-real.toml \
        --seconds 900 --target 0.7 --seeds 0 1          # both, 900 s each, Flywheel first
    .venv/bin/python bench/learning_side_by_side.py -c configs/examples/ticket-routing.toml \
        --seconds 1200 --target 0.5 --first trl
    .venv/bin/python bench/learning_side_by_side.py --seconds 60 --out-dir runs/sbs-smoke  # smoke
    cd ~/my-task && python ~/flywheel/bench/learning_side_by_side.py -c my-task.toml  # a user's

The TRL side needs TRL: `pip install -e '.[bench]'` in the Flywheel checkout
(this script says so in one line, before anything runs, when it is missing).
Both runs start in the working directory this script is run from, so a run
file's relative paths mean what they mean to `flywheel up` run there
(services/runtime/settings.py, "Paths"): a user's run file works from its
own directory, with its data beside it.

Same model (the run file's `[stack] model`), task (its `[task]`: prompts as
the buffer formats them, the reward called as the workers call it), the
same held-out evaluation (the validation split, every `eval_every` steps,
services/tasks/evaluate.py) and the same hyper-parameters as the services
resolve them (bench/trl_grpo.py `demo_hparams`, `trl_alike`), on the same
machine one after the other, each given the same wall-clock budget:

- Flywheel: `flywheel up -c <the run file, with this run's paths>` (its
  engines, workers, buffer, trainer and sync as the run file places them);
  each metrics row is placed at its `time` (when the trainer wrote it). Its
  clock starts when the trainer starts its RL (a trained row's `time` less
  its `elapsed`; an evaluation's row carries the `elapsed` of the version it
  measured, and the step-0 evaluation runs beside the first steps) and the
  stack is stopped (SIGINT) after `--seconds` on that clock.
- TRL: bench/trl_grpo.py in a subprocess, one process, `--trl-threads`
  torch threads (default: the threads the Flywheel run uses, engines ×
  engine_threads + the trainer's cpu_threads); its clock starts after its
  step-0 evaluation, it stops after `--seconds`.

Both curves are validation pass@1 against seconds since that start, the
evaluations included in the seconds (each pays for its own): a point is
placed when its evaluation's result is known. Each point also records when
the weights it evaluated were trained (Flywheel's row `elapsed`; TRL's
`elapsed` less that evaluation's own seconds), so time to target is given
both ways: *evaluated* (when the run could know it had reached it) and
*trained* (when it had): Flywheel's evaluations run beside training at idle
priority and TRL's stop training while they run, so the two differ by
different amounts on each side. Written to
DIR: side_by_side.md (the tables for bench/results_learning.md: one per seed,
then each ratio's median over the seeds), side_by_side.json (every point and
figure), and per seed DIR/seed-N: side_by_side.png (both curves in one plot)
and the runs' own files under flywheel/ and trl/.

Figures: trained samples/s (samples in optimizer steps / budget seconds;
Flywheel's buffer trains only groups with a reward spread, TRL trains every
group, so "with signal/s" counts TRL's samples in groups with a spread);
time to target (the first evaluation ≥ `--target`; quantised to
`eval_every` steps); the ratios Flywheel / TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import status_rate  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "demo-real.toml"


@dataclass
class Side:
    name: str
    ok: bool = False
    steps: int = 0
    samples: int = 0
    signal_fraction: float = 1.0  # trained samples in groups whose rewards differ
    # seconds when evaluated, acc, step, seconds when those weights were trained
    curve: list[tuple[float, float, int, float]] = field(default_factory=list)
    generated_per_s: float | None = None
    load: tuple[float, float] = (0.0, 0.0)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    seconds: float | None = None  # RL seconds the rates are over (None: the budget)
    # of those, the seconds training stood still for its own evaluations (TRL's; Flywheel's
    # run beside the training, so none of its seconds are taken out)
    eval_seconds: float = 0.0

    def per_s(self, budget: float) -> float:
        return self.samples / (self.seconds or budget)

    def per_training_s(self, budget: float) -> float:
        """Trained samples per second of training: evaluations excluded on both sides."""
        return self.samples / max((self.seconds or budget) - self.eval_seconds, 1e-9)

    def signal_per_s(self, budget: float) -> float:
        return self.per_s(budget) * self.signal_fraction

    def time_to(self, target: float, trained: bool = False) -> float | None:
        return next((tt if trained else t for t, acc, _, tt in self.curve if acc >= target), None)


TRL_MISSING = (
    "side_by_side: TRL is not installed (the TRL side needs it): pip install -e '.[bench]' "
    f"in {ROOT}"
)


def trl_missing() -> str | None:
    """The one line to print when TRL cannot be imported (None: it can)."""
    import importlib.util

    return TRL_MISSING if importlib.util.find_spec("trl") is None else None


def env() -> dict[str, str]:
    """The subprocesses' environment: the working directory and the repo root importable (a
    reward by import path, `my_rewards:fn` beside a user's run file or
    configs.examples.ticket_routing from the repo root, resolves as `flywheel up` resolves
    it: services/cli.py puts the working directory on sys.path)."""
    parts = [str(Path.cwd()), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in parts if p)}


def run_threads(config: Path) -> int:
    """Torch threads the Flywheel run uses: engines × engine_threads + the trainer's."""
    from services.runtime.settings import load_settings
    from services.stack.settings import StackSettings
    from services.trainer.settings import TrainerSettings

    s = load_settings(StackSettings, config)
    trainer = load_settings(TrainerSettings, config).runtime.cpu_threads or 1
    return s.engines * max(s.engine_threads, 1) + trainer


def model_of(config: Path, model: str | None) -> Path:
    from services.models.resolve import resolve_model
    from services.runtime.settings import load_settings
    from services.stack.settings import StackSettings

    if model:
        return resolve_model(model, key="--model")
    return resolve_model(load_settings(StackSettings, config).model, key="[stack] model")


def task_set(config: Path) -> Any:
    from services.runtime.settings import load_settings
    from services.stack.settings import StackSettings

    return load_settings(StackSettings, config).task_set()


def run_flywheel(config: Path, model: Path, out: Path, seconds: float, seed: int) -> Side:
    from services.stack.demo import fresh_run_dir, run_file

    side = Side("Flywheel")
    run_dir = (out / "flywheel").resolve()
    fresh_run_dir(run_dir)
    rf = run_file(config, run_dir, model, None, None, seed)
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "services", "up", "-c", str(rf), "--quiet", "--no-check"]
    print(f"side_by_side: flywheel: {' '.join(cmd[2:])}", flush=True)
    load0, t_wall = os.getloadavg()[0], time.monotonic()
    log = (out / "flywheel.log").open("w")
    proc = subprocess.Popen(cmd, cwd=Path.cwd(), env=env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    # RL's start, on the wall clock: a trained row's `time` less its `elapsed` (an evaluation's
    # row has the `elapsed` of the version it measured, not its own: it cannot tell)
    seen, t0, rows = 0, None, []
    while proc.poll() is None:
        time.sleep(0.5)
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        for line in lines[seen:]:
            if line.strip():
                row = json.loads(line)
                if t0 is None and "batch_id" in row:
                    t0 = float(row["time"]) - float(row["elapsed"])
                rows.append(row)
        seen = len(lines)
        if t0 is not None and time.time() - t0 >= seconds:
            break
    stop(proc)
    log.close()
    side.wall_s, side.load = time.monotonic() - t_wall, (load0, os.getloadavg()[0])
    # each row placed when it was written (its `time`): an evaluation's when its result was known
    kept = [(float(r["time"]) - t0, r) for r in rows if t0 is not None]
    kept = [(t, r) for t, r in kept if t <= seconds]
    side.curve = [(round(t, 1), float(r["eval_accuracy"]), int(r["step"]), round(r["elapsed"], 1))
                  for t, r in kept if "eval_accuracy" in r]  # fmt: skip
    trained = [r for _, r in kept if "samples" in r]
    side.steps = max((int(r["step"]) for r in trained), default=0)
    side.samples = int(sum(r["samples"] for r in trained))
    side.generated_per_s = status_rate(run_dir / "status.log")
    side.ok = t0 is not None
    if not side.ok:
        side.notes.append(f"no metrics row; see {out / 'flywheel.log'}")
    return side


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop `flywheel up` with SIGINT to it alone (it stops its services, then its NATS,
    in order), then its whole process group harder if it hangs."""
    steps = ((lambda: os.kill(proc.pid, signal.SIGINT), 120),
             (lambda: os.killpg(proc.pid, signal.SIGTERM), 30),
             (lambda: os.killpg(proc.pid, signal.SIGKILL), 10))  # fmt: skip
    for send, wait in steps:
        if proc.poll() is not None:
            return
        send()
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def run_trl(config: Path, model: Path, out: Path, seconds: float, threads: int, seed: int) -> Side:
    side = Side("TRL GRPOTrainer")
    dest = out / "trl"
    dest.mkdir(parents=True, exist_ok=True)
    metrics = dest / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "trl_grpo.py"), "-c", str(config),
           "--model", str(model), "--seconds", str(seconds), "--threads", str(threads),
           "--metrics-out", str(metrics), "--output-dir", str(dest / "trl-out"),
           "--seed", str(seed)]  # fmt: skip
    print(f"side_by_side: trl: {' '.join(cmd[1:])}", flush=True)
    load0, t_wall = os.getloadavg()[0], time.monotonic()
    p = subprocess.run(cmd, cwd=Path.cwd(), env=env(), capture_output=True, text=True,
                       check=False)  # fmt: skip
    side.wall_s, side.load = time.monotonic() - t_wall, (load0, os.getloadavg()[0])
    (out / "trl.log").write_text(p.stdout + p.stderr)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith('{"steps"')]
    if p.returncode != 0 or not lines:
        side.notes.append(f"trl_grpo.py exited {p.returncode}; see {out / 'trl.log'}")
        return side
    s = json.loads(lines[-1])
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    # the end-of-budget evaluation lands just past the budget: it is the budget's last point;
    # eval_s is cumulative, so a row's own evaluation is its difference from the row before
    own = [r["eval_s"] - (rows[i - 1]["eval_s"] if i else 0.0) for i, r in enumerate(rows)]
    side.curve = [(round(r["elapsed"], 1), float(r["eval_accuracy"]), int(r["step"]),
                   round(r["elapsed"] - e, 1)) for r, e in zip(rows, own, strict=True)]  # fmt: skip
    side.steps, side.samples = int(s["steps"]), int(s["samples"])
    side.signal_fraction = float(s["signal_fraction"])
    # TRL checks the budget at a step's end, so its last step may end past it: its rates
    # are over its own RL seconds (evaluations included, as Flywheel's), not the budget
    side.seconds = max(float(s["rl_seconds"]), 1e-9)
    side.eval_seconds = float(s["eval_seconds"])
    side.generated_per_s = side.samples / side.seconds
    if side.seconds > seconds:
        side.notes.append(f"its last step ended at {side.seconds:.0f} s (budget {seconds:.0f} s)")
    side.ok = True
    return side


def plot(sides: list[Side], target: float | None, title: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in sides:
        if s.curve:
            line = ax.plot([c[0] for c in s.curve], [c[1] for c in s.curve], "o-", label=s.name)
            trained = [c[3] for c in s.curve]  # when the evaluated weights were trained
            ax.plot(trained, [c[1] for c in s.curve], "x--", lw=1, color=line[0].get_color(),
                    label=f"{s.name}, weights trained at")  # fmt: skip
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target}")
    ax.set_xlabel("seconds of RL (o: when an evaluation's result was known)")
    ax.set_ylabel("validation pass@1 (greedy)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}x"


def report(sides: list[Side], budget: float, target: float | None, command: str) -> str:
    fw, trl = sides if sides[0].name == "Flywheel" else sides[::-1]

    def f(x: float | None, spec: str = ".0f") -> str:
        return "not reached" if x is None else format(x, spec)

    lines = [f"`{command}`", "",
             "| | steps | trained samples/s | per s of training | with signal/s | "
             "generated samples/s | validation first → last | "
             "time to target s, evaluated / trained | load 1-min |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in (fw, trl):
        acc = f"{s.curve[0][1]:.3f} → {s.curve[-1][1]:.3f}" if s.curve else "—"
        ttt = (f"{f(s.time_to(target))} / {f(s.time_to(target, trained=True))}"
               if target is not None else "—")  # fmt: skip
        gen = f(s.generated_per_s, ".2f") if s.generated_per_s is not None else "—"
        lines.append(f"| {s.name} | {s.steps} | {s.per_s(budget):.2f} | "
                     f"{s.per_training_s(budget):.2f} | "
                     f"{s.signal_per_s(budget):.2f} | {gen} | {acc} | {ttt} | "
                     f"{s.load[0]:.1f} → {s.load[1]:.1f} |")  # fmt: skip

    def to(s: Side, trained: bool) -> float | None:
        return s.time_to(target, trained) if target is not None else None

    lines += ["",
              f"Flywheel / TRL: trained samples/s {ratio(fw.per_s(budget), trl.per_s(budget))} "
              f"(target ≥ 1.3x), per second of training "
              f"{ratio(fw.per_training_s(budget), trl.per_training_s(budget))} "
              f"(target ≥ 1.0x), with signal/s "
              f"{ratio(fw.signal_per_s(budget), trl.signal_per_s(budget))}, time to target "
              f"{ratio(to(fw, False), to(trl, False))} evaluated, "
              f"{ratio(to(fw, True), to(trl, True))} trained (target ≤ 0.7x). "
              f"Budget {budget:.0f} s each."]  # fmt: skip
    for s in (fw, trl):
        lines += [f"- {s.name}: {n}" for n in s.notes]
    return "\n".join(lines) + "\n"


def quotient(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ratios(sides: list[Side], budget: float, target: float | None) -> dict[str, float | None]:
    """Flywheel / TRL on each figure the issue sets a target for."""
    fw, trl = sides if sides[0].name == "Flywheel" else sides[::-1]

    def to(s: Side, trained: bool) -> float | None:
        return s.time_to(target, trained) if target is not None else None

    return {
        "trained samples/s": quotient(fw.per_s(budget), trl.per_s(budget)),
        "per second of training": quotient(fw.per_training_s(budget), trl.per_training_s(budget)),
        "time to target, evaluated": quotient(to(fw, False), to(trl, False)),
        "time to target, trained": quotient(to(fw, True), to(trl, True)),
    }


TARGETS = {"trained samples/s": "≥ 1.3x", "per second of training": "≥ 1.0x",
           "time to target, evaluated": "≤ 0.7x", "time to target, trained": "—"}  # fmt: skip


def across_seeds(per_seed: dict[int, dict[str, float | None]]) -> str:
    """One line per ratio: its median over the seeds and each seed's, so one lucky seed
    cannot stand for the run file (a ratio a seed could not measure, e.g. a side that never
    reached the target, is shown as — and left out of the median)."""
    lines = ["| Flywheel / TRL | median | " + " | ".join(f"seed {k}" for k in per_seed)
             + " | target |", "|---|---|" + "---|" * len(per_seed) + "---|"]  # fmt: skip
    for name, target in TARGETS.items():
        got = [r[name] for r in per_seed.values()]
        known = [x for x in got if x is not None]
        med = f"{statistics.median(known):.2f}x" if known else "—"
        cells = " | ".join("—" if x is None else f"{x:.2f}x" for x in got)
        lines.append(f"| {name} | {med} | {cells} | {target} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", type=Path, default=DEFAULT_CONFIG, help="the run file")
    p.add_argument("--model", help="model directory (default: the run file's [stack] model)")
    p.add_argument("--seconds", type=float, default=900.0, help="wall-clock budget of each")
    p.add_argument("--target", type=float, help="validation pass@1 for time to target")
    p.add_argument("--first", choices=("flywheel", "trl"), default="flywheel")
    p.add_argument("--trl-threads", type=int, help="TRL's torch threads (default: Flywheel's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="each seed runs both sides, one after the other (DIR/seed-N); "
                   "the ratios are given per seed and as their median")  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "side-by-side")
    args = p.parse_args(argv)
    from services.runtime.errors import ConfigError

    try:  # the run file read as every command reads it; a bad key: one line, no traceback
        model = model_of(args.config, args.model)
        threads = args.trl_threads or run_threads(args.config)
        task_set(args.config).check(data=True)  # its data found from here, as up would
    except ConfigError as e:
        print(f"side_by_side: {e}", file=sys.stderr)
        return 2
    if missing := trl_missing():  # before a 15-minute Flywheel side, not after it
        print(missing, file=sys.stderr)
        return 2
    command = "bench/learning_side_by_side.py " + " ".join(sys.argv[1:] if argv is None else argv)
    sections, per_seed, docs, ok = [f"`{command.strip()}`", ""], {}, [], True
    for seed in args.seeds:
        out = args.out_dir / f"seed-{seed}"
        out.mkdir(parents=True, exist_ok=True)
        order = [args.first, *(k for k in ("flywheel", "trl") if k != args.first)]
        sides = [
            run_flywheel(args.config, model, out, args.seconds, seed)
            if k == "flywheel"
            else run_trl(args.config, model, out, args.seconds, threads, seed)
            for k in order
        ]
        ok = ok and all(s.ok for s in sides)
        png = plot(sides, args.target, f"{model.name}, {args.config.name}, seed {seed}: "
                   "TRL and Flywheel", out / "side_by_side.png")  # fmt: skip
        sections += [f"### seed {seed} ({png.relative_to(args.out_dir)})", "",
                     report(sides, args.seconds, args.target, command.strip())]  # fmt: skip
        per_seed[seed] = ratios(sides, args.seconds, args.target)
        load = statistics.median([x for s in sides for x in s.load])
        docs.append({"seed": seed, "order": order, "sides": [asdict(s) for s in sides],
                     "ratios": per_seed[seed], "load_median": load})  # fmt: skip
        print(sections[-1], end="", flush=True)
    md = "\n".join([*sections, across_seeds(per_seed)])
    (args.out_dir / "side_by_side.md").write_text(md)
    doc = {"command": command.strip(), "config": str(args.config), "model": str(model),
           "seconds": args.seconds, "target": args.target, "trl_threads": threads,
           "seeds": docs}  # fmt: skip
    (args.out_dir / "side_by_side.json").write_text(json.dumps(doc, indent=2))
    print(across_seeds(per_seed), end="")
    print(f"side_by_side: {args.out_dir / 'side_by_side.md'}, "
          f"{args.out_dir / 'side_by_side.json'}", flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

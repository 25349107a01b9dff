"""End to end: Flywheel's demo at max_staleness 0, 1, 2 against TRL's GRPOTrainer.

    .venv/bin/python bench/e2e.py [--seconds 300] [--target 0.9] [--staleness 0 1 2]
                                  [--run-dir runs/bench-e2e] [--out bench/results_e2e.md]
    .venv/bin/python bench/e2e.py --quick          # smoke run: k=1 and TRL, 30 s each
    .venv/bin/python bench/e2e.py --placement --staleness 0 1 --no-trl  # pinned vs not
    .venv/bin/python bench/e2e.py --profile --seconds 90   # k=0 per-stage breakdown
                                                           # (bench/step_profile.py)
    .venv/bin/python bench/e2e.py --profile --config bench/configs/smollm2-arith.toml \
        --model /work/models/SmolLM2-135M-Instruct --steps 12 \
        --variant fp32:FLYWHEEL_TRAINER_RUNTIME__PRECISION=fp32 --variant auto: --repeats 2
        # the same breakdown for any run file (a real model), `flywheel up --steps N`
        # per run; each --variant NAME:ENV=VALUE,... is one configuration (environment
        # overrides of the run file), run in turn, `--repeats` times interleaved

Every configuration runs in this one invocation, one after the other, on
the same SFT warm start, so the ratios compare runs under the same (shared,
noisy) machine load; the load average is recorded around each run.

- Flywheel: `flywheel demo --run-dir DIR --quiet --keep --max-staleness K
  --rl-seconds S --target-accuracy T` as a subprocess. The first run builds
  the SFT model in DIR (the demo's own warm start) unless one is there;
  every later run, and TRL, restart RL from that same `DIR/model-sft`. The
  demo's hyper-parameters are whatever `configs/demo.toml` and
  `services/stack/demo.py` say at run time; this script does not set them.
  After each run its metrics.jsonl, status.log and summary.json are copied
  to DIR/bench/<name>/ (the next `--keep` run deletes them).
- TRL: `bench/trl_grpo.py` (same model directory, prompts, reward,
  hyper-parameters, held-out evaluation; see its docstring).

Figures, per configuration:

- time to target: the first `elapsed` (seconds since the trainer service
  started, its step-0 evaluation included) whose held-out accuracy is
  ≥ target; "not reached" if none within the cap. Evaluations happen every
  `eval_every` steps, so this is quantised to those steps.
- trained samples/s: samples in the trainer's batches (metrics.jsonl
  `samples`, zero-variance groups already filtered out) / last `elapsed`.
- with signal/s: trained samples in groups whose rewards differ, the only
  ones a group-relative advantage gives a gradient. Flywheel's buffer
  filters the others out (the demo's `filter_zero_variance`), so there it
  equals trained samples/s; TRL trains every group, so its rate is
  trained × the share of scored samples in groups with differing rewards
  (bench/trl_grpo.py `SignalCount`).
- generated samples/s: Flywheel — the mean of the stack's status lines'
  `samples/s` (rate of the rollout workers' `flywheel_rollout_samples_total`
  between scrapes, every `status_interval_s`), i.e. everything generated,
  filtered groups included; TRL — every generated sample is trained on, so
  steps × prompts × samples / (RL time − evaluation time).
- trainer idle: the trainer's cumulative `idle_fraction` (time waiting for
  a batch / (waiting + compute + publish)) at its last step; for TRL, the
  trainer is idle while it generates, but it reports no such split.

Ratios: time to target against max_staleness=0 (synchronous) of this run;
samples/s against TRL of this run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
STATUS_RATE = re.compile(r"samples/s ([0-9.]+)")


@dataclass
class RunResult:
    name: str
    ok: bool
    rl_seconds: float | None = None
    steps: int | None = None
    time_to_target: float | None = None
    trained_per_s: float | None = None
    signal_per_s: float | None = None  # trained samples in groups whose rewards differ
    generated_per_s: float | None = None
    idle_fraction: float | None = None
    acc_start: float | None = None
    acc_end: float | None = None
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average before, after
    wall_s: float = 0.0
    rep: int = 1  # which repetition (--repeats)
    notes: list[str] = field(default_factory=list)

    @property
    def s_per_step(self) -> float | None:
        """Wall seconds per optimizer step: the pipeline's speed, apart from RL's luck."""
        return self.rl_seconds / self.steps if self.rl_seconds and self.steps else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_reaching(rows: list[dict[str, Any]], target: float) -> float | None:
    """`elapsed` of the first evaluation at or above `target`."""
    for r in rows:
        if r.get("eval_accuracy", -1.0) >= target:
            return float(r["elapsed"])
    return None


def status_rate(status_log: Path) -> float | None:
    """Mean rollout samples/s over the stack's status lines (equal scrape intervals)."""
    if not status_log.is_file():
        return None
    rates = [float(m.group(1)) for m in map(STATUS_RATE.search, status_log.read_text().splitlines())
             if m]  # fmt: skip
    return statistics.fmean(rates) if rates else None


def flywheel_result(name: str, dest: Path, target: float) -> RunResult:
    """Figures of one demo run from the files it left (copied to `dest`)."""
    rows = read_jsonl(dest / "metrics.jsonl")
    steps = [r for r in rows if "samples" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    res = RunResult(name, ok=bool(steps))
    if not steps:
        res.notes.append("no trainer steps in metrics.jsonl")
        return res
    last = steps[-1]
    res.rl_seconds = float(last["elapsed"])
    res.steps = int(last["step"])
    res.trained_per_s = sum(r["samples"] for r in steps) / max(res.rl_seconds, 1e-9)
    # The buffer's zero-variance filter (the demo's) trains only groups with a signal.
    if _filters_zero_variance(dest / "run.toml"):
        res.signal_per_s = res.trained_per_s
    res.idle_fraction = last.get("idle_fraction")
    res.time_to_target = first_reaching(evals, target)
    res.acc_start = evals[0]["eval_accuracy"] if evals else None
    res.acc_end = evals[-1]["eval_accuracy"] if evals else None
    res.generated_per_s = status_rate(dest / "status.log")
    summary = dest / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        res.notes.append(
            f"demo summary (500 held-out): {s['accuracy_before']:.3f} → "
            f"{s['accuracy_after']:.3f} in {s['rl_steps']} steps, {s['rl_seconds']:.0f}s of `up`"
        )
    return res


def _filters_zero_variance(run_toml: Path) -> bool:
    import tomllib

    doc = tomllib.loads(run_toml.read_text()) if run_toml.is_file() else {}
    return bool(doc.get("buffer", {}).get("filter_zero_variance", True))


def run_flywheel(args: argparse.Namespace, k: int, keep: bool, placed: bool = False) -> RunResult:
    name = f"flywheel k={k}"
    cmd = [PY, "-m", "services", "demo", "--run-dir", str(args.run_dir), "--quiet",
           "--max-staleness", str(k), "--rl-seconds", str(args.seconds),
           "--rl-steps", "100000"]  # fmt: skip
    cmd += ["--keep"] if keep else []
    cmd += ["--target-accuracy", str(args.target)] if args.stop_at_target else []
    if placed:
        name += " placed"
        cmd += ["--cpus", *args.placement]
    print(f"e2e: {name}: {' '.join(cmd[1:])}", flush=True)
    dest = args.run_dir / "bench" / f"k{k}{'-placed' if placed else ''}"
    load0 = os.getloadavg()[0]
    t = time.monotonic()
    log = args.run_dir.parent / f"{args.run_dir.name}-k{k}.log"
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
    wall = time.monotonic() - t
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for part in ("metrics.jsonl", "status.log", "summary.json", "run.toml"):
        if (args.run_dir / part).is_file():
            shutil.copy2(args.run_dir / part, dest / part)
    shutil.copy2(log, dest / "demo.log")
    res = flywheel_result(name, dest, args.target)
    res.load, res.wall_s = (load0, os.getloadavg()[0]), wall
    if code.returncode != 0:
        res.notes.append(f"demo exited {code.returncode}; see {dest / 'demo.log'}")
    return res


def run_trl(args: argparse.Namespace) -> RunResult:
    dest = args.run_dir / "bench" / "trl"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    cmd = [PY, str(ROOT / "bench" / "trl_grpo.py"), "--model", str(args.run_dir / "model-sft"),
           "--seconds", str(args.seconds), "--metrics-out", str(dest / "metrics.jsonl"),
           "--output-dir", str(dest / "trl-out")]  # fmt: skip
    cmd += ["--target-accuracy", str(args.target)] if args.stop_at_target else []
    print(f"e2e: trl: {' '.join(cmd[1:])}", flush=True)
    load0 = os.getloadavg()[0]
    t = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t
    (dest / "trl.log").write_text(p.stdout + p.stderr)
    res = RunResult("TRL GRPOTrainer", ok=False, load=(load0, os.getloadavg()[0]), wall_s=wall)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith('{"steps"')]
    if p.returncode != 0 or not lines:
        res.notes.append(f"trl_grpo.py exited {p.returncode}; see {dest / 'trl.log'}")
        return res
    s = json.loads(lines[-1])
    rows = read_jsonl(dest / "metrics.jsonl")
    res.ok = True
    res.rl_seconds, res.steps = s["rl_seconds"], s["steps"]
    res.time_to_target = first_reaching(rows, args.target)
    res.generated_per_s = s["samples_per_s"]
    res.trained_per_s = s["samples_per_s"]
    res.signal_per_s = s["samples_per_s"] * s["signal_fraction"]
    res.acc_start, res.acc_end = s["accuracy_start"], s["accuracy_end"]
    res.notes.append(
        f"TRL: {s['eval_seconds']:.0f}s of its {s['rl_seconds']:.0f}s were held-out evaluation "
        f"(excluded from its samples/s; {s['samples_per_s_incl_eval']:.0f}/s with them)"
    )
    return res


def fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(results: list[RunResult], target: float, seconds: float) -> str:
    """Every run, each compared with k=0 and TRL of its own repetition."""
    out = []
    notes = []
    for rep in sorted({r.rep for r in results}):
        mine = [r for r in results if r.rep == rep]
        rows, rep_notes = _rows(mine, target, seconds)
        out += rows
        notes += rep_notes
    cols = ["config", "steps", "RL s", f"time to {target} (s)", "vs k=0", "generated samples/s",
            "vs TRL", "trained samples/s", "vs TRL", "trainer idle", "acc start → end",
            "with signal/s", "vs TRL", "load 1m before/after"]  # fmt: skip
    head = "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|\n"
    return head + "\n".join(out) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _ratio(m: dict[str, Any], base: dict[str, Any] | None, key: str) -> str:
    return f"{m[key] / base[key]:.2f}x" if base and base[key] and m[key] else "-"


def summary(results: list[RunResult], target: float) -> str:
    """Medians over the repetitions: time to target is noisy (RL's luck), s/step is not."""
    names = list(dict.fromkeys(r.name for r in results))
    med = {
        n: {
            "ttt": _median([r.time_to_target for r in results if r.name == n]),
            "reached": sum(r.time_to_target is not None for r in results if r.name == n),
            "runs": sum(1 for r in results if r.name == n),
            "sps": _median([r.s_per_step for r in results if r.name == n]),
            "gen": _median([r.generated_per_s for r in results if r.name == n]),
            "tr": _median([r.trained_per_s for r in results if r.name == n]),
            "sig": _median([r.signal_per_s for r in results if r.name == n]),
        }
        for n in names
    }
    sync, trl = med.get("flywheel k=0"), med.get("TRL GRPOTrainer")
    cols = ["config", f"median time to {target} (s)", "reached", "vs k=0", "median s/step",
            "vs k=0", "median generated samples/s", "vs TRL", "median trained samples/s",
            "vs TRL", "median with signal/s", "vs TRL"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for n, m in med.items():
        lines.append(
            f"| {n} | {fmt(m['ttt'], '.0f')} | {m['reached']}/{m['runs']} "
            f"| {_ratio(m, sync, 'ttt')} | {fmt(m['sps'], '.3f')} | {_ratio(m, sync, 'sps')} "
            f"| {fmt(m['gen'], '.0f')} | {_ratio(m, trl, 'gen')} "
            f"| {fmt(m['tr'], '.0f')} | {_ratio(m, trl, 'tr')} "
            f"| {fmt(m['sig'], '.0f')} | {_ratio(m, trl, 'sig')} |"
        )
    return "\n".join(lines) + "\n"


def _rows(results: list[RunResult], target: float, seconds: float) -> tuple[list[str], list[str]]:
    sync = next((r for r in results if r.name == "flywheel k=0" and r.ok), None)
    trl = next((r for r in results if r.name.startswith("TRL") and r.ok), None)
    out = []
    for r in results:
        ttt = fmt(r.time_to_target, ".0f", f"not reached in {seconds:.0f}")
        vs_sync = (f"{r.time_to_target / sync.time_to_target:.2f}x"
                   if sync and sync.time_to_target and r.time_to_target else "-")  # fmt: skip
        vs_gen = (f"{r.generated_per_s / trl.generated_per_s:.2f}x"
                  if trl and trl.generated_per_s and r.generated_per_s else "-")  # fmt: skip
        vs_tr = (f"{r.trained_per_s / trl.trained_per_s:.2f}x"
                 if trl and trl.trained_per_s and r.trained_per_s else "-")  # fmt: skip
        vs_sig = (f"{r.signal_per_s / trl.signal_per_s:.2f}x"
                  if trl and trl.signal_per_s and r.signal_per_s else "-")  # fmt: skip
        out.append(
            f"| {r.name} (run {r.rep}) | {fmt(r.steps, 'd')} | {fmt(r.rl_seconds, '.0f')} "
            f"| {ttt} | {vs_sync} "
            f"| {fmt(r.generated_per_s, '.0f')} | {vs_gen} | {fmt(r.trained_per_s, '.0f')} "
            f"| {vs_tr} | {fmt(r.idle_fraction, '.0%')} "
            f"| {fmt(r.acc_start, '.3f')} → {fmt(r.acc_end, '.3f')} "
            f"| {fmt(r.signal_per_s, '.0f')} | {vs_sig} "
            f"| {r.load[0]:.1f} / {r.load[1]:.1f} |"
        )
    notes = [f"- {r.name} (run {r.rep}): {n}" for r in results for n in r.notes]
    return out, notes


def provenance(started: str, args: argparse.Namespace) -> str:
    """When, on what load, and which demo settings (they are still being tuned)."""
    import hashlib

    files = [ROOT / "configs" / "demo.toml", ROOT / "services" / "stack" / "demo.py"]
    digests = ", ".join(
        f"{f.relative_to(ROOT)} sha256 {hashlib.sha256(f.read_bytes()).hexdigest()[:12]}"
        for f in files
    )
    sft = args.run_dir / "model-sft" / "flywheel-manifest.json"
    sft_sha = json.loads(sft.read_text()).get("sha256", "?")[:12] if sft.is_file() else "?"
    return (
        f"Started {started}; {os.cpu_count()} CPUs; RL cap {args.seconds:.0f}s per run; "
        f"{digests}; SFT model sha256 {sft_sha}.\n"
    )


@dataclass
class UpRun:
    """One `flywheel up --steps N` of a run file under a variant's environment."""

    variant: str
    rep: int
    steps: int
    wall_s: float
    load: tuple[float, float]
    code: int
    breakdown: dict[str, Any]


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:KEY=VALUE,KEY=VALUE` (or `NAME:`) -> (NAME, environment overrides)."""
    name, _, rest = text.partition(":")
    env = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {part!r} is not KEY=VALUE")
        env[key.strip()] = value.strip()
    return name or "run", env


def up_once(args: argparse.Namespace, variant: str, env: dict[str, str], rep: int) -> UpRun:
    """Wipe the run dir, `flywheel up -c CONFIG --steps N` under `env`, profile what it left."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tomllib

    from step_profile import breakdown_of  # bench/step_profile.py

    doc = tomllib.loads(args.config.read_text())
    run = doc.get("run", "default")
    run_dir = args.run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    full_env = {**os.environ, **env, "FLYWHEEL_STACK_RUN_DIR": str(run_dir)}
    if args.model is not None:
        full_env["FLYWHEEL_STACK_MODEL"] = str(args.model)
    cmd = [PY, "-m", "services", "up", "-c", str(args.config), "--steps", str(args.steps),
           "--quiet", "--no-check"]  # fmt: skip
    log = run_dir.parent / f"{run_dir.name}-{variant}-{rep}.log"
    print(f"e2e: {variant} (run {rep}): {' '.join(f'{k}={v}' for k, v in env.items())} "
          f"{' '.join(cmd[1:])}", flush=True)  # fmt: skip
    load0 = os.getloadavg()[0]
    t = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        p = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT,
                           check=False)  # fmt: skip
    wall = time.monotonic() - t
    b = breakdown_of(run_dir, run) if (run_dir / "metrics.jsonl").is_file() else {"steps": 0}
    keep = args.run_dir.parent / f"{run_dir.name}-{variant}-{rep}"
    if keep.exists():
        shutil.rmtree(keep)
    keep.mkdir(parents=True)
    for part in ("metrics.jsonl", "status.log"):
        if (run_dir / part).is_file():
            shutil.copy2(run_dir / part, keep / part)
    res = UpRun(variant, rep, b.get("steps", 0), wall, (load0, os.getloadavg()[0]), p.returncode, b)
    print(f"e2e: {variant} (run {rep}): exit {p.returncode}, {wall:.0f} s, "
          f"{res.steps} steps profiled; log {log}", flush=True)  # fmt: skip
    return res


def run_config_profile(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Each variant's k=0 breakdown on a run file, interleaved, with ratios to the first."""
    sys.path.insert(0, str(ROOT / "bench"))
    from step_profile import compare_table  # bench/step_profile.py

    variants = [parse_variant(v) for v in (args.variant or ["run:"])]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    runs = [up_once(args, name, env, rep) for rep in range(1, args.repeats + 1)
            for name, env in variants]  # fmt: skip
    model = args.model or "the run file's"
    head = (f"Started {started}; {os.cpu_count()} CPUs; run file {args.config}; model "
            f"{model}; {args.steps} steps per run.\n\n")  # fmt: skip
    for name, env in variants:
        head += f"- {name}: {' '.join(f'{k}={v}' for k, v in env.items()) or '(as the file)'}\n"
    runs_md = "\n".join(
        f"- {r.variant} run {r.rep}: exit {r.code}, {r.wall_s:.0f} s wall, {r.steps} steps "
        f"profiled, load 1m {r.load[0]:.1f} → {r.load[1]:.1f}"
        for r in runs
    )
    md = head + "\n" + runs_md + "\n\n" + compare_table([(f"{r.variant} {r.rep}", r.breakdown)
                                                        for r in runs])  # fmt: skip
    print("\n" + md)
    if args.out is not None:
        cmd = " ".join([".venv/bin/python", "bench/e2e.py", *(argv or sys.argv[1:])])
        args.out.write_text(f"<!-- generated by: {cmd} -->\n\n{md}")
    return 0 if all(r.code == 0 and r.steps for r in runs) else 1


def run_profile(args: argparse.Namespace, argv: list[str] | None) -> int:
    """k=0 for `--seconds` (no target stop), then the per-stage breakdown of its steps."""
    sys.path.insert(0, str(ROOT / "bench"))
    from step_profile import profile  # bench/step_profile.py

    args.stop_at_target = False
    have_sft = (args.run_dir / "model-sft" / "flywheel-manifest.json").is_file()
    res = run_flywheel(args, 0, keep=have_sft and not args.fresh_sft)
    md = (
        f"k=0 run: {fmt(res.steps, 'd')} steps in {fmt(res.rl_seconds, '.0f')} s "
        f"(load 1m {res.load[0]:.1f} → {res.load[1]:.1f}).\n\n" + profile(args.run_dir, "demo")
    )
    print("\n" + md)
    if args.out is not None:
        cmd = " ".join([".venv/bin/python", "bench/e2e.py", *(argv or sys.argv[1:])])
        args.out.write_text(f"<!-- generated by: {cmd} -->\n\n{md}")
    return 0 if res.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-e2e")
    p.add_argument("--seconds", type=float, default=300.0, help="cap on each run's RL time")
    p.add_argument("--target", type=float, default=0.9, help="held-out accuracy to time")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--no-stop-at-target", dest="stop_at_target", action="store_false",
                   help="run every configuration for the full --seconds")  # fmt: skip
    p.add_argument("--no-trl", dest="trl", action="store_false", help="skip the TRL baseline")
    p.add_argument("--quick", action="store_true", help="smoke run: k=1 and TRL, 30 s each")
    p.add_argument("--fresh-sft", action="store_true",
                   help="rebuild the SFT warm start even if DIR/model-sft exists")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each configuration (interleaved); medians reported")  # fmt: skip
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument("--placement", nargs="*", metavar="ROLE=CORES",
                   help="also run each k with the roles pinned ([stack] cpus); "
                   "default: trainer=0 engine=1 (2 cores)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="one k=0 run, then its per-stage breakdown")  # fmt: skip
    p.add_argument("--config", type=Path,
                   help="--profile: run this file with `flywheel up`, not the demo")  # fmt: skip
    p.add_argument("--model", type=Path, help="--config: the model directory ([stack] model)")
    p.add_argument("--steps", type=int, default=12, help="--config: trainer steps per run")
    p.add_argument("--variant", action="append", metavar="NAME:ENV=VALUE,...",
                   help="--config: a configuration (environment overrides)")  # fmt: skip
    args = p.parse_args(argv)
    args.run_dir = args.run_dir.resolve()
    if args.profile and args.config is not None:
        if args.run_dir == (ROOT / "runs" / "bench-e2e").resolve():
            args.run_dir = (ROOT / "runs" / "bench-real").resolve()
        return run_config_profile(args, argv)
    if args.profile:
        return run_profile(args, argv)
    if args.placement == []:
        args.placement = ["trainer=0", "engine=1"]
    if args.quick:
        args.seconds, args.staleness = 30.0, [1]
    have_sft = (args.run_dir / "model-sft" / "flywheel-manifest.json").is_file()
    have_sft = have_sft and not args.fresh_sft
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results: list[RunResult] = []
    for rep in range(1, args.repeats + 1):
        for k in args.staleness:
            for placed in (False, True) if args.placement else (False,):
                results.append(run_flywheel(args, k, keep=have_sft or bool(results), placed=placed))
                results[-1].rep = rep
                print(f"e2e: {results[-1]}", flush=True)
        if args.trl:
            results.append(run_trl(args))
            results[-1].rep = rep
            print(f"e2e: {results[-1]}", flush=True)
    md = provenance(started, args) + "\n" + table(results, args.target, args.seconds)
    if args.repeats > 1:
        md += "\nMedians over the repetitions:\n\n" + summary(results, args.target)
    print("\n" + md)
    if args.out is not None:
        cmd = " ".join([".venv/bin/python", "bench/e2e.py", *(argv or sys.argv[1:])])
        args.out.write_text(f"<!-- generated by: {cmd} -->\n\n{md}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

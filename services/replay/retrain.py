"""`flywheel replay train`: the trainer service re-run on a recorded run's batches.

What runs is the trainer itself (`python -m services.trainer`, the process
`flywheel up` plans for the run file, its cores and threads included) with
`[trainer] replay = true`: it reads the run's BATCHES stream as recorded
(services/trainer/replay.py), trains each batch with its own step code,
writes versions and checkpoints under the replay's directory, announces
nothing, and exits after the last batch (or the run's step count). Then
each version is compared with the run's (compare.py).

With the run's settings the versions must be the run's, byte for byte
(docs/replay.md says when that holds); `--set key=value` changes a
`[trainer]` setting (`optim.lr=1e-5`, `loss.kl_coef=0.01`): an ablation
on identical data, written to its own directory, compared all the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.replay import records
from services.replay.compare import VersionDiff, compare_version
from services.replay.source import Hooks, RecordedRun, connected
from services.runtime.errors import ConfigError
from services.weights import published_dir

PREFIX = "FLYWHEEL_TRAINER_"


@dataclass(frozen=True)
class Plan:
    """What a replay trains: the recorded batches' steps, and how many of them."""

    batches: int  # batches recorded (decodable)
    first_step: int
    last_step: int
    steps: int  # steps to train: the run's own count when known, else every batch
    undecodable: list[int]


def set_env(assignments: list[str]) -> dict[str, str]:
    """`--set optim.lr=1e-5` → FLYWHEEL_TRAINER_OPTIM__LR=1e-5 (a [trainer] setting)."""
    env = {}
    for a in assignments:
        key, eq, value = a.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {a!r}: expected key=value, e.g. optim.lr=1e-5")
        env[PREFIX + key.strip().replace(".", "__").upper()] = value
    return env


def run_rows(metrics_file: Path) -> list[dict[str, Any]]:
    """A trainer metrics file's rows of trained steps ([] if it is absent)."""
    if not metrics_file.is_file():
        return []
    rows = [json.loads(ln) for ln in metrics_file.read_text().splitlines() if ln.strip()]
    return [r for r in rows if "batch_id" in r]


def timing(rows: list[dict[str, Any]]) -> dict[str, float]:
    """A trainer's time over its rows: wall (first row's start to last row) and compute."""
    if not rows:
        return {}
    compute = sum(float(r.get("compute_s", 0.0)) for r in rows)
    return {
        "steps": len(rows),
        "elapsed_s": float(rows[-1]["elapsed"]),
        "compute_s": compute,
        "compute_s_per_step": compute / len(rows),
    }


async def plan(rec: RecordedRun, url: str, steps: int | None) -> Plan:
    """Read the whole recording first: a trimmed stream fails here, before any training."""
    async with connected(rec, url) as js:
        got = await records.batches(js, rec.run)
    step_ids = [b.step for _, b in got.messages]
    known = max((int(r["step"]) for r in run_rows(rec.run_dir / "metrics.jsonl")), default=None)
    last = max(step_ids) + 1  # a batch of step k makes version k + 1
    return Plan(len(step_ids), min(step_ids), last - 1, steps or known or last, got.undecodable)


def out_of(rec: RecordedRun, out: Path | None) -> Path:
    """The replay's directory: empty or new, never the run's own."""
    d = (out or rec.out_dir).resolve()
    if d == rec.run_dir or (rec.run_dir / "weights").resolve() == (d / "weights"):
        raise ConfigError(f"--out {d} is the run's own directory: give another")
    if (d / "checkpoints").is_dir() and any((d / "checkpoints").iterdir()):
        raise ConfigError(f"{d} already holds a replay: give another --out, or delete it")
    d.mkdir(parents=True, exist_ok=True)
    return d


def trainer_command(
    rec: RecordedRun, url: str, hooks: Hooks, out: Path, steps: int, sets: dict[str, str]
) -> tuple[tuple[str, ...], dict[str, str], tuple[int, ...]]:
    """The run's trainer process, pointed at the recording and at `out`."""
    if hooks.trainer_process is not None:
        argv, env, cpus = hooks.trainer_process(rec.config, url)
    else:
        argv = (sys.executable, "-m", "services.trainer", "-c", str(rec.config))
        env, cpus = {f"{PREFIX}NATS__URL": url, f"{PREFIX}RUN": rec.run}, ()
    env = {
        **env,
        f"{PREFIX}REPLAY": "true",
        f"{PREFIX}METRICS_PORT": "0",
        f"{PREFIX}WEIGHTS_TRANSPORT": "disk",
        f"{PREFIX}WEIGHTS_ROOT": str(out / "weights"),
        f"{PREFIX}CHECKPOINT_DIR": str(out / "checkpoints"),
        f"{PREFIX}METRICS_FILE": str(out / "metrics.jsonl"),
        f"{PREFIX}MAX_STEPS": str(steps),
        **sets,
    }
    return argv, env, cpus


def run_trainer(
    argv: tuple[str, ...], env: dict[str, str], cpus: tuple[int, ...], log: Path
) -> int:
    """The trainer to its end, its output in `log`; its exit status."""

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with log.open("ab") as f:
        proc = subprocess.run(
            argv,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=pin if cpus and sys.platform == "linux" else None,
            check=False,
        )
    return proc.returncode


def compare_all(rec: RecordedRun, out: Path, steps: int) -> list[VersionDiff]:
    return [
        compare_version(
            v,
            published_dir(rec.run_dir / "weights", rec.run, v),
            published_dir(out / "weights", rec.run, v),
        )
        for v in range(1, steps + 1)
    ]


def train_main(
    rec: RecordedRun,
    url: str,
    hooks: Hooks,
    *,
    out: Path | None,
    steps: int | None,
    sets: list[str],
) -> int:
    """`flywheel replay train`: exit 0 when done (and, without --set, every version
    compared is the run's bit for bit), 1 when a version differs, the trainer's status
    when it fails."""
    env_sets = set_env(sets)
    p = asyncio.run(plan(rec, url, steps))
    d = out_of(rec, out)
    print(
        f"flywheel replay: {p.batches} batches recorded (steps {p.first_step}..{p.last_step}); "
        f"training {p.steps} steps into {d}"
        + (f" with {' '.join(sets)}" if sets else " with the run's settings")
    )
    argv, env, cpus = trainer_command(rec, url, hooks, d, p.steps, env_sets)
    started = time.perf_counter()
    code = run_trainer(argv, env, cpus, d / "trainer.log")
    wall = time.perf_counter() - started
    if code != 0:
        tail = (d / "trainer.log").read_text(errors="replace").splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        print(
            f"flywheel replay: the trainer exited {code} (log: {d / 'trainer.log'})",
            file=sys.stderr,
        )
        return code
    diffs = compare_all(rec, d, p.steps)
    report = summary(rec, d, p, sets, wall, diffs)
    (d / "replay.json").write_text(json.dumps(report, indent=2) + "\n")
    for diff in diffs:
        print(f"  {diff.line()}")
    print(timing_line(report))
    code, line = verdict(diffs, sets)
    print(line, file=sys.stderr if code else sys.stdout)
    return code


def verdict(diffs: list[VersionDiff], sets: list[str]) -> tuple[int, str]:
    """A replay's exit status and its one-line conclusion.

    A replay passes only on what it compared: every version the run still has must have
    been written by the replay (one it did not write is a failure, never "not compared"),
    and, without `--set`, at least one version must have been compared, and every one
    compared equal byte for byte. An ablation (`--set`) is not held to the run's weights,
    only to having written its own.
    """
    if not any(d.written for d in diffs):
        return 1, (
            f"flywheel replay: the replay wrote no version (v1..v{len(diffs)}): nothing was "
            "compared (see its trainer.log)"
        )
    unwritten = [d.version for d in diffs if d.missing_in == "replay"]
    if unwritten:
        return 1, (
            f"flywheel replay: the replay wrote no weights for versions {unwritten}, which the "
            "run has: they were not compared (see its trainer.log)"
        )
    if sets:
        return 0, f"flywheel replay: ablation ({' '.join(sets)}) written"
    bad = [d.version for d in diffs if d.missing_in is None and not d.bytes_equal]
    if bad:  # different bytes, or different files
        return 1, (
            f"flywheel replay: versions {bad} differ from the run's (docs/replay.md: what "
            "bit-exactness needs)"
        )
    compared = [d for d in diffs if d.missing is None]
    if not compared:
        return 1, (
            "flywheel replay: no version of the run left to compare: nothing was compared "
            "(the run keeps its versions only as long as [sync] keep_last says)"
        )
    return 0, f"flywheel replay: {len(compared)} versions equal to the run's, bit for bit"


def summary(
    rec: RecordedRun, out: Path, p: Plan, sets: list[str], wall: float, diffs: list[VersionDiff]
) -> dict[str, Any]:
    return {
        "run": rec.run,
        "out": str(out),
        "steps": p.steps,
        "batches_recorded": p.batches,
        "undecodable_seqs": p.undecodable,
        "set": sets,
        "replay_wall_s": wall,
        "replay": timing(run_rows(out / "metrics.jsonl")),
        "original": timing(run_rows(rec.run_dir / "metrics.jsonl")[: p.steps]),
        "versions": [d.as_dict() for d in diffs],
    }


def timing_line(r: dict[str, Any]) -> str:
    o, n = r["original"], r["replay"]
    if not o or not n:
        return f"flywheel replay: {r['steps']} steps in {r['replay_wall_s']:.1f}s"
    return (
        f"flywheel replay: {n['steps']} steps in {r['replay_wall_s']:.1f}s with start-up "
        f"(trainer {n['elapsed_s']:.1f}s, compute {n['compute_s']:.1f}s); the run's trainer: "
        f"{o['elapsed_s']:.1f}s, compute {o['compute_s']:.1f}s"
    )

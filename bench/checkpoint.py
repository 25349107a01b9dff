"""Saving one published version in one process: weights directory + checkpoint, before vs after.

    .venv/bin/python bench/checkpoint.py [--reps 25] [--base REV]

What the trainer service's `persist` does per published step at
max_staleness 0 (bench/results_profile.md: 'weights save + announce', 17% of
the step), on the demo's tiny model (services/models/tiny_model.py, the
default spec) after one RL step, from a `Snapshot`:

- `before`       : `--base`'s services/trainer/state.py (loaded from git),
                   `save_weights`, then its `save_checkpoint` (DCP's files);
- `one file`     : this tree, `save_weights`, then `save_checkpoint` (one
                   `state.pt`): the format alone;
- `one file + thread`: this tree's `save_version`, the weights directory on
                   a thread while the checkpoint is staged (what `persist` runs);
- `(weights directory alone)`: `save_weights` only, the floor of the above.

Each repetition runs them in turn (the same load for all), each with
a new step number and `prune_checkpoints(keep=2)` as the service does; the
medians and their ratios to `before` are printed. A last, untimed
repetition counts each variant's `os.fsync` calls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def old_state_module(rev: str, into: Path) -> ModuleType:
    """services/trainer/state.py as of `rev`, imported under another name."""
    src = subprocess.run(
        ["git", "show", f"{rev}:services/trainer/state.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = into / "old_state.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_state", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_state"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def counting_fsyncs() -> Iterator[list[int]]:
    calls = [0]
    real = os.fsync

    def counted(fd: int) -> None:
        calls[0] += 1
        real(fd)

    os.fsync = counted
    try:
        yield calls
    finally:
        os.fsync = real


def variants(trainer, old: ModuleType, work: Path) -> dict[str, Callable[[object, int], None]]:
    """name -> save(snapshot, step): one published version written the way `name` does."""
    from services.trainer.state import prune_checkpoints, save_checkpoint
    from services.trainer.step import save_version

    def paths(name: str, step: int) -> tuple[Path, Path]:
        weights = work / name / "weights"
        shutil.rmtree(weights, ignore_errors=True)  # the last rep's directory: not timed
        return weights / f"v{step:06d}", work / name / "ckpt"

    def weights_only(snap, step: int) -> None:
        out, _ = paths("weights_only", step)
        trainer.save_weights(out, overwrite=True, state_dict=snap.weights)

    def before(snap, step: int) -> None:
        out, ckpt = paths("before", step)
        trainer.save_weights(out, overwrite=True, state_dict=snap.weights)
        old.save_checkpoint(trainer, ckpt, {"seq": step}, snap)
        old.prune_checkpoints(ckpt, 2)

    def one_file(snap, step: int) -> None:
        out, ckpt = paths("one_file", step)
        trainer.save_weights(out, overwrite=True, state_dict=snap.weights)
        save_checkpoint(trainer, ckpt, {"seq": step}, snap)
        prune_checkpoints(ckpt, 2)

    def threaded(snap, step: int) -> None:
        out, ckpt = paths("threaded", step)
        save_version(trainer, out, ckpt, {"seq": step}, snap)
        prune_checkpoints(ckpt, 2)

    return {
        "before": before,
        "one file": one_file,
        "one file + thread": threaded,
        "(weights directory alone)": weights_only,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--base", default="main", help="git revision of the 'before' state.py")
    args = ap.parse_args()

    from transformers.utils import logging as hf_logging

    from proto.weight_version import after_steps
    from services.models.tiny_model import TinyModelSpec, write_tiny_model
    from services.trainer.state import snapshot
    from services.trainer.trainer import Trainer
    from tests.integration.trainer.trainer_helpers import random_batch

    hf_logging.disable_progress_bar()  # save_pretrained's bar, once per save
    base = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as d:
        work = Path(d)
        model = write_tiny_model(work / "model", TinyModelSpec())
        trainer = Trainer.from_pretrained(model, _cfg())
        trainer.train_step(random_batch(seed=1))  # AdamW's moments exist, as in a run
        trainer.weight_version = after_steps(trainer.step)
        snap = snapshot(trainer)
        params = sum(p.numel() for p in trainer.model.parameters())
        runs = variants(trainer, old_state_module(args.base, work), work)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(1, args.reps + 2):  # rep 1: warm-up, not counted
            for name, save in runs.items():
                t = time.perf_counter()
                save(dataclasses.replace(snap, step=rep), rep)
                if rep > 1:
                    times[name].append(time.perf_counter() - t)
        fsyncs = {}
        for name, save in runs.items():
            with counting_fsyncs() as calls:
                save(dataclasses.replace(snap, step=args.reps + 2), args.reps + 2)
            fsyncs[name] = calls[0]
    print(f"tiny model (default spec, {params:,} parameters), AdamW after 1 step, one process;")
    print(f"median of {args.reps} reps, 'before' = state.py at {args.base} ({base})\n")
    print("| save weights + checkpoint | median ms | min–max ms | vs before | fsyncs |")
    print("|---|---:|---|---:|---:|")
    ref = statistics.median(times["before"])
    for name, ts in times.items():
        med = statistics.median(ts)
        span = f"{min(ts) * 1e3:.1f}–{max(ts) * 1e3:.1f}"
        print(f"| {name} | {med * 1e3:.1f} | {span} | {med / ref:.2f}× | {fsyncs[name]} |")


def _cfg():
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig

    return TrainConfig(optim=OptimConfig(lr=1e-5), model=ModelConfig(micro_batch_tokens=4096))


if __name__ == "__main__":
    main()

"""The trainer's persisted state: checkpoints (model, optimizer, LR schedule, trainer
state, RNG, stream position), and the metrics file made to agree with them on resume.

Layout of one checkpoint (`<root>/step-00000042/`):

    state.pt            one process: model + optimizer + RNG, one file
    state/, rng-rank<r>.pt   under FSDP2: DCP shards, each rank's RNG
                        (RNG: torch's and Python's generators, and the trainer's own,
                        randomness.py, which the steps draw from)
    trainer-state.json  step, weight_version, scheduler state, the entropy bonus
                        weight (the adaptive controller's state), input_position
    <root>/latest       the name of the newest complete checkpoint

Which of the two the model state takes is stateformat.py's choice (and why).
Everything else is small and written as JSON, so nothing is unpickled.

Atomicity and durability: a checkpoint is staged (`stage_checkpoint`: all
ranks write into `.step-N.tmp/`, each file fsynced) and then committed
(`commit_checkpoint`: after a barrier rank 0 renames it to `step-N/`,
atomically replaces `latest`, and fsyncs the directories). A crash at any
point, of the process or of the machine, leaves the previous `latest`
valid; once `commit_checkpoint` returns, the checkpoint survives a power
cut, which is what lets the trainer announce its version (publishing.py).
The two halves are separate so that one process can stage the checkpoint
while its weights directory is being written and commit it only after
(step.py: a checkpoint never names a version whose directory is missing).
`input_position` is opaque here (the trainer service records the stream
sequence of the last batch).

The metrics file holds one row per trained step, in order, and a row is
appended only once its step is checkpointed; `reconcile_rows` restores that
contract after a crash (its docstring says how).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.runtime.diskroom import ensure_room, full_disk, tensor_bytes
from services.runtime.durable import fsync_path
from services.trainer.distributed import DistInfo, barrier
from services.trainer.stateformat import (
    CheckpointError,
    model_optim_state,
    read_state,
    rng_state,
    write_state,
)
from services.trainer.trainer import Trainer

log = logging.getLogger(__name__)

LATEST = "latest"


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _copy_to_cpu(tree: Any, memo: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """A copy of a nested state dict with every tensor copied to CPU.

    Tensors that share memory (tied embeddings) stay shared in the copy, so
    the copy describes the same model (save_pretrained drops tied keys by
    identity).
    """
    if isinstance(tree, torch.Tensor):
        key = (
            tree.untyped_storage().data_ptr(),
            tree.storage_offset(),
            tuple(tree.shape),
            tuple(tree.stride()),
            tree.dtype,
            tree.device,
        )
        if key not in memo:
            memo[key] = tree.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(tree, dict):
        return {k: _copy_to_cpu(v, memo) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_copy_to_cpu(v, memo) for v in tree)
    return tree


@dataclass(frozen=True)
class Snapshot:
    """A single-process trainer's state after one step, copied out of the live objects.

    Writing a checkpoint and the weights takes time (serialising, fsyncs,
    safetensors, hashing: tens of ms per step for the demo's 0.5M model on
    these 2 cores, seconds for real models); from a snapshot they
    are written while the next step trains. Under FSDP2 writing is a
    collective that must run on every rank in step with training, so
    snapshots are for `world_size == 1` only.
    """

    step: int
    weight_version: int
    state: dict[str, Any]  # {"model": ..., "optim": ...} as get_state_dict gives them, on CPU
    weights: dict[str, torch.Tensor]  # the full model state dict, for save_pretrained
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    entropy_coef: float = 0.0  # the next step's entropy bonus weight (adaptive control)


def snapshot(trainer: Trainer) -> Snapshot:
    """Copy what a checkpoint and a weights directory need out of `trainer` (one process)."""
    if trainer.info.world_size != 1:
        raise ValueError("snapshots are for a single process; under FSDP2 save in step")
    memo: dict[tuple[Any, ...], torch.Tensor] = {}
    weights = trainer.full_state_dict()
    assert weights is not None  # rank 0 of 1
    return Snapshot(
        step=trainer.step,
        weight_version=trainer.weight_version,
        state=_copy_to_cpu(model_optim_state(trainer), memo),
        weights=_copy_to_cpu(weights, memo),
        scheduler=copy.deepcopy(trainer.scheduler.state_dict()),
        rng=rng_state(trainer.generator),
        entropy_coef=trainer.entropy_coef,
    )


# A checkpoint is the model and AdamW's two moments in fp32 (SmolLM2-135M: 1.6 GB), and
# keep_checkpoints of them stay while the next is written.
ROOM_HINT = ("free space there, or point [trainer] checkpoint_dir at a larger disk; "
             "[trainer] keep_checkpoints of them stay while the next is written")  # fmt: skip


@dataclass(frozen=True)
class Staged:
    """A checkpoint written into its temporary directory, not yet the `latest`."""

    root: Path
    tmp: Path
    final: Path
    info: DistInfo


def stage_checkpoint(
    trainer: Trainer,
    root: str | Path,
    input_position: dict[str, Any] | None = None,
    snap: Snapshot | None = None,
) -> Staged:
    """Write a checkpoint of `trainer` into `root`'s temporary directory (every rank).

    With `snap`, the snapshot is written instead of the live state (one
    process; the trainer may be training the next step meanwhile).
    """
    root = Path(root)
    info = trainer.info
    step = snap.step if snap else trainer.step
    final = root / _step_name(step)
    tmp = root / f".{final.name}.tmp"
    state = snap.state if snap else model_optim_state(trainer)
    rng = snap.rng if snap else rng_state(trainer.generator)
    need, what = tensor_bytes(state), f"checkpoint {final.name}"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        ensure_room(root, need, what, ROOM_HINT)
        tmp.mkdir(parents=True)
    barrier(info)
    try:
        write_state(tmp, state, rng, info)
    except Exception as e:
        disk = full_disk(e, root, need, what, ROOM_HINT)
        if not info.distributed:  # its bytes would stay on the full disk; DCP: ranks share tmp
            shutil.rmtree(tmp, ignore_errors=True)
        if disk is not None:
            raise disk from e
        raise
    if info.is_main:
        doc = {
            "step": step,
            "weight_version": snap.weight_version if snap else trainer.weight_version,
            "world_size": info.world_size,
            "scheduler": snap.scheduler if snap else trainer.scheduler.state_dict(),
            "entropy_coef": snap.entropy_coef if snap else trainer.entropy_coef,
            "input_position": input_position or {},
        }
        (tmp / "trainer-state.json").write_text(json.dumps(doc, indent=2))
        fsync_path(tmp / "trainer-state.json")
    return Staged(root, tmp, final, info)


def commit_checkpoint(staged: Staged) -> Path:
    """Make a staged checkpoint the durable `latest` (every rank); returns its directory."""
    root, tmp, final, info = staged.root, staged.tmp, staged.final, staged.info
    barrier(info)
    if info.is_main:
        fsync_path(tmp)  # its entries, before it gets a name `latest` can point at
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(final.name)
        fsync_path(latest_tmp)
        os.replace(latest_tmp, root / LATEST)
        fsync_path(root)  # both renames
    barrier(info)
    return final


def save_checkpoint(
    trainer: Trainer,
    root: str | Path,
    input_position: dict[str, Any] | None = None,
    snap: Snapshot | None = None,
) -> Path:
    """Stage and commit a checkpoint of `trainer` under `root` (collective: every rank)."""
    return commit_checkpoint(stage_checkpoint(trainer, root, input_position, snap))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None if there is none yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names a missing checkpoint {path.name}", path=path)
    return path


def load_checkpoint(trainer: Trainer, path: str | Path) -> dict[str, Any]:
    """Restore `trainer` from checkpoint `path` (either format); returns its input_position."""
    path = Path(path)
    try:
        doc = json.loads((path / "trainer-state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"unreadable checkpoint {path}: {e}", path=path) from e
    read_state(trainer, path, int(doc["world_size"]))
    trainer.scheduler.load_state_dict(doc["scheduler"])
    trainer.step = int(doc["step"])
    trainer.weight_version = int(doc["weight_version"])
    # The adaptive controller goes on from where it was (checkpoints from before it: the
    # configured start); a fixed weight is the run file's, whatever the last run used.
    if trainer.cfg.loss.entropy_control == "adaptive":
        trainer.entropy_coef = float(doc.get("entropy_coef", trainer.cfg.loss.entropy_coef))
    return dict(doc["input_position"])


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (rank 0, after a save)."""
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=False)


def reconcile_rows(metrics_file: Path | None, checkpoint_dir: Path) -> None:
    """Make the metrics file agree with the checkpoint we resumed from.

    A row is appended after its step's checkpoint, so a crash between the
    two leaves the checkpointed step without a row; rows of steps after
    the checkpoint (publish_every > 1) describe training that died with
    the process and is done again. Both would break the file's contract
    of one row per trained step, in order (tests/chaos checks it): drop
    rows past the checkpoint, and add a `recovered` row for its step.
    """
    ckpt = latest_checkpoint(checkpoint_dir)
    if metrics_file is None or ckpt is None or not metrics_file.is_file():
        return
    doc = json.loads((ckpt / "trainer-state.json").read_text())
    step, batch_id = int(doc["step"]), doc["input_position"].get("batch_id")
    lines = metrics_file.read_text().splitlines()
    rows = [(ln, _json_row(ln)) for ln in lines]
    # An unparsable line is a row cut by the crash itself: dropped too.
    keep = [ln for ln, r in rows if r is not None and int(r.get("step", 0)) <= step]
    if batch_id and not any((_json_row(ln) or {}).get("batch_id") == batch_id for ln in keep):
        row = {"step": step, "batch_id": batch_id, "time": time.time(), "recovered": True}
        keep.append(json.dumps(row))
        log.warning("trainer: metrics row of step %d was lost in a crash; recovered", step)
    if keep != lines:
        tmp = metrics_file.with_name(f".{metrics_file.name}.tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        tmp.replace(metrics_file)


def _json_row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None

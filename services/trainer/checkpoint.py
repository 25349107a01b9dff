"""Checkpoint and resume: model, optimizer, LR schedule, trainer state, RNG.

Layout of one checkpoint (`<root>/step-00000042/`):

    state/              model + optimizer, torch.distributed.checkpoint (DCP)
    trainer-state.json  step, weight_version, scheduler state, input_position
    rng-rank<r>.pt      this rank's torch (and CUDA) RNG state, python's random
    <root>/latest       the name of the newest complete checkpoint

Why DCP for model and optimizer rather than one gathered state dict: under
FSDP2 every rank writes its own shards in parallel, no rank ever holds the
full optimizer state (2× the model in fp32 for AdamW), and DCP reshards on
load, so a run may resume on a different number of GPUs. The same calls
work in a single process (no process group). Everything else is small and
written as JSON, so nothing is unpickled; the RNG tensors are read with
`torch.load(weights_only=True)`.

Atomicity: all ranks write into `.step-N.tmp/`; after a barrier rank 0
renames it to `step-N/` and then atomically replaces `latest`. A crash at
any point leaves the previous `latest` valid. `input_position` is opaque
here (the trainer service records the stream sequence of the last batch).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.common.errors import FlywheelError
from services.trainer.distributed import barrier
from services.trainer.trainer import Trainer

LATEST = "latest"


class CheckpointError(FlywheelError, OSError):
    """A checkpoint is missing or unreadable; names the path."""

    def __init__(self, message: str, *, path: Path):
        super().__init__(message)
        self.path = path


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it runs without a process group; that is our single-process path."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _model_optim_state(trainer: Trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": json.dumps(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = json.loads(state["python"])
    random.setstate((v, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    trainer: Trainer, root: str | Path, input_position: dict[str, Any] | None = None
) -> Path:
    """Write a checkpoint of `trainer` under `root` (collective: call on every rank)."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    info = trainer.info
    final = root / _step_name(trainer.step)
    tmp = root / f".{final.name}.tmp"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    with _quiet_single_process():
        dcp.save(_model_optim_state(trainer), checkpoint_id=tmp / "state")
    torch.save(_rng_state(), tmp / f"rng-rank{info.rank}.pt")
    if info.is_main:
        doc = {
            "step": trainer.step,
            "weight_version": trainer.weight_version,
            "world_size": info.world_size,
            "scheduler": trainer.scheduler.state_dict(),
            "input_position": input_position or {},
        }
        (tmp / "trainer-state.json").write_text(json.dumps(doc, indent=2))
    barrier(info)
    if info.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / LATEST)
    barrier(info)
    return final


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
    """Restore `trainer` from checkpoint `path`; returns the saved input_position."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    try:
        doc = json.loads((path / "trainer-state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"unreadable checkpoint {path}: {e}", path=path) from e
    state = _model_optim_state(trainer)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path / "state")
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    trainer.scheduler.load_state_dict(doc["scheduler"])
    trainer.step = int(doc["step"])
    trainer.weight_version = int(doc["weight_version"])
    # Same world size: each rank gets its own stream back; otherwise rank 0's.
    rng = path / f"rng-rank{trainer.info.rank}.pt"
    if int(doc["world_size"]) != trainer.info.world_size or not rng.is_file():
        rng = path / "rng-rank0.pt"
    _set_rng_state(torch.load(rng, weights_only=True))
    return dict(doc["input_position"])

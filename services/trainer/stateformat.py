"""How a checkpoint holds the model, optimizer and RNG state: one file, or DCP shards.

- one file (`state.pt`): a plain single process. One `torch.save` of
  {"model", "optim", "rng"}, fsynced. The process holds the whole state
  anyway, and DCP in one process still writes every item as its own
  `torch.save` with its own fsyncs: for the demo's 0.5M model 118 items and
  ~11 fsyncs, 83–146 ms of a 264 ms publish at max_staleness 0
  (bench/results_profile.md).
- DCP (`state/` + `rng-rank<r>.pt`): under FSDP2 (any process group). Every
  rank writes its own shards in parallel, no rank ever holds the full
  optimizer state (2× the model in fp32 for AdamW), and DCP reshards on
  load, so a run may resume on a different number of GPUs.

`format_for` is the one place that chooses what to write; `format_of` reads
what a checkpoint holds, so a checkpoint written before the one-file format
existed (always DCP) still loads, and a one-file checkpoint loads under
FSDP2 too (the full state, sharded by `set_state_dict`). Nothing is
unpickled: tensors and containers only, `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import warnings
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from services.runtime.durable import fsync_path
from services.runtime.errors import FlywheelError
from services.trainer.distributed import DistInfo
from services.trainer.trainer import Trainer

ONE_FILE = "state.pt"
DCP_DIR = "state"
# torch's save settings are process-wide: one save at a time sets and restores them
_SAVE_LOCK = threading.Lock()


class CheckpointError(FlywheelError, OSError):
    """A checkpoint is missing or unreadable; names the path."""

    def __init__(self, message: str, *, path: Path):
        super().__init__(message)
        self.path = path


class StateFormat(StrEnum):
    ONE_FILE = "one-file"
    DCP = "dcp"


def format_for(info: DistInfo) -> StateFormat:
    """What a trainer in `info`'s configuration writes (the only place that decides)."""
    return StateFormat.DCP if info.distributed else StateFormat.ONE_FILE


def format_of(path: Path) -> StateFormat:
    """What checkpoint `path` holds; CheckpointError if neither."""
    if (path / ONE_FILE).is_file():
        return StateFormat.ONE_FILE
    if (path / DCP_DIR).is_dir():
        return StateFormat.DCP
    raise CheckpointError(f"{path} holds no model state ({ONE_FILE} or {DCP_DIR}/)", path=path)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it runs without a process group; that is a single-process load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(trainer: Trainer, **kw: Any) -> Any:  # -> StateDictOptions
    """With a LoRA adapter the frozen base is left out: it is the run's model directory,
    and the checkpoint holds the adapter and its optimizer state only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainer.adapter is not None, **kw)


def model_optim_state(trainer: Trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))
    if trainer.adapter is not None:  # the adapter only
        from services.trainer.lora import trained_only

        model_sd = trained_only(trainer.model, model_sd)
    return {"model": model_sd, "optim": optim_sd}


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """The process's generators (torch's default ones, Python's) and, under "trainer",
    the trainer's own `generator` (randomness.py), whose stream the steps draw from."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": json.dumps(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if generator is not None:
        state["trainer"] = generator.get_state()
    return state


def _set_rng_state(state: dict[str, Any], trainer: Trainer) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = json.loads(state["python"])
    random.setstate((v, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    # A checkpoint from before the trainer had a generator of its own has none: the
    # trainer's stays as seeded from the run's seed (that run drew from the default one).
    if "trainer" in state:
        trainer.generator.set_state(state["trainer"])


def _save_fsynced(obj: Any, path: Path) -> None:
    """`torch.save` without the zip records' CRC-32, then fsync.

    `torch.load` never checks those CRCs (tests/unit/trainer/test_stateformat.py
    shows a flipped data byte loading silently), so computing them is work
    nothing reads: for SmolLM2-135M's 1.6 GB of model and AdamW state, 0.32 ->
    0.06 user CPU s per checkpoint (bench/results_sync.md, "What a version
    costs"). What makes a checkpoint trustworthy is unchanged: it is fsynced
    before it is renamed into place (state.py), so a torn one is never `latest`.
    """
    with _SAVE_LOCK, _without_crc32():
        torch.save(obj, path)
    fsync_path(path)


def _without_crc32() -> contextlib.AbstractContextManager[Any]:
    """torch's save settings with compute_crc32 off, where the installed torch has the
    switch (newer than the oldest torch pyproject.toml allows); as they are otherwise."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config.save, "compute_crc32"):
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})  # type: ignore[attr-defined]


def _load(path: Path) -> Any:
    """`torch.load` of a file this module wrote; a torn or foreign file is a CheckpointError."""
    try:
        return torch.load(path, weights_only=True)
    # Which error a damaged file gives is up to its bytes (torn: RuntimeError, OSError,
    # EOFError; other bytes: KeyError, the unpickler's own error): each means unreadable.
    except Exception as e:
        raise CheckpointError(f"unreadable checkpoint file {path}: {e}", path=path) from e


def write_state(tmp: Path, state: dict[str, Any], rng: dict[str, Any], info: DistInfo) -> None:
    """Write `state` ({"model", "optim"}) and this rank's `rng` into `tmp` (every rank)."""
    if format_for(info) is StateFormat.ONE_FILE:
        _save_fsynced({**state, "rng": rng}, tmp / ONE_FILE)
        return
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=tmp / DCP_DIR)  # fsyncs its own files
    _save_fsynced(rng, tmp / f"rng-rank{info.rank}.pt")


def read_state(trainer: Trainer, path: Path, saved_world_size: int) -> None:
    """Restore `trainer`'s model, optimizer and RNG from checkpoint `path` (every rank)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    distributed = trainer.info.distributed
    fmt = format_of(path)
    if fmt is StateFormat.ONE_FILE:
        state = _load(path / ONE_FILE)
        rng = state["rng"]
    else:
        state, rng = _read_dcp(trainer, path, saved_world_size)
    _check_adapter_keys(trainer, state["model"], path)
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        # A one-file state is the full one: under FSDP2 each rank keeps its shards of it.
        options=_options(
            trainer,
            full_state_dict=fmt is StateFormat.ONE_FILE and distributed,
            # An adapter's checkpoint has no base weights (checked whole just above).
            strict=trainer.adapter is None,
        ),
    )
    _set_rng_state(rng, trainer)


def _check_adapter_keys(trainer: Trainer, model_state: dict[str, Any], path: Path) -> None:
    """CheckpointError unless an adapter run's checkpoint holds exactly its adapter (a full
    fine-tuning checkpoint, or one of another rank or target set, is not resumable)."""
    if trainer.adapter is None:
        return
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if set(model_state) != trained:
        missing, extra = sorted(trained - set(model_state)), sorted(set(model_state) - trained)
        raise CheckpointError(
            f"{path} is not a checkpoint of this [trainer.lora] adapter: "
            f"missing {missing[:3]}, unexpected {extra[:3]}",
            path=path,
        )


def _read_dcp(
    trainer: Trainer, path: Path, saved_world_size: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    state = model_optim_state(trainer)  # DCP loads in place, resharding to this layout
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path / DCP_DIR)
    except dcp.api.CheckpointException as e:
        where = path / DCP_DIR
        raise CheckpointError(f"unreadable checkpoint state {where}: {e}", path=where) from e
    # Same world size: each rank gets its own stream back; otherwise rank 0's.
    rng = path / f"rng-rank{trainer.info.rank}.pt"
    if saved_world_size != trainer.info.world_size or not rng.is_file():
        rng = path / "rng-rank0.pt"
    return state, _load(rng)

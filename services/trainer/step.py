"""One optimizer step, on every rank: the batch in, a new weight version out when due.

Rank 0 reads the batch (batches.py) and hands it to the other ranks as
bytes (a length, then a uint8 tensor: no pickle); every rank then runs the
same step. When a step is due to publish (`publish_every`), its weights
directory and its checkpoint are saved, the checkpoint recording the
stream sequence of the batch and committed only once the directory is
complete (so a checkpoint never names a version whose directory is
missing, and a restart resumes at the next batch).

In one process the saving is taken off the critical path: the step's
state is copied out (a `Snapshot`, ~1 ms for the demo model) and written
while the next step trains (`persist` from loop.py), the weights directory
on a thread beside the checkpoint's staging; only the checkpoint's commit
waits for the directory. Under FSDP2 saving is a collective, so every rank
saves within the step, one thing after the other (two threads' collectives
could interleave differently on different ranks).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proto.codec import decode, encode
from proto.messages import TrainBatch
from proto.weight_version import after_steps
from services.trainer.distributed import DistInfo
from services.trainer.settings import TrainerSettings
from services.trainer.state import (
    Snapshot,
    commit_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    snapshot,
    stage_checkpoint,
)
from services.trainer.trainer import Trainer
from services.trainer.wire import to_tensor_batch
from services.weights import Manifest, published_dir

STOP = -1  # broadcast length that tells the other ranks to stop


def broadcast_bytes(data: bytes | None, info: DistInfo) -> bytes | None:
    """Rank 0's `data` on every rank (None = stop). Plain tensors, no pickle."""
    if not info.distributed:
        return data
    import torch.distributed as dist

    dev = info.device if dist.get_backend() == "nccl" else torch.device("cpu")
    n = torch.tensor([STOP if data is None else len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(n, src=0)
    size = int(n.item())
    if size == STOP:
        return None
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        if info.is_main and data is not None
        else torch.empty(size, dtype=torch.uint8, device=dev)
    )
    dist.broadcast(buf, src=0)
    return data if info.is_main else bytes(buf.cpu().numpy().tobytes())


@dataclass
class StepResult:
    metrics: dict[str, float]
    step: int  # the trainer's step after this batch (= the weight version it publishes)
    published: Path | None = None  # the new weights directory, once saved
    sha256: str = ""
    size_bytes: int = 0
    compute_s: float = 0.0
    publish_s: float = 0.0  # saving weights + checkpoint (overlapped with the next step: 1 rank)
    snapshot: Snapshot | None = None  # one process: the state `persist` writes later


def compute_one(trainer: Trainer, batch: TrainBatch) -> StepResult:
    """One optimizer step on `batch`; the weight version follows the step."""
    received_at = time.time()  # the profile's clock: other services stamp messages with it
    started = time.perf_counter()
    core = to_tensor_batch(batch)
    encoded = time.perf_counter()
    metrics = trainer.train_step(core)
    trainer.weight_version = after_steps(trainer.step)
    done = time.perf_counter()
    metrics |= {"received_at": received_at, "time_encode_s": encoded - started}
    return StepResult(metrics, trainer.step, compute_s=done - started)


def publish_due(trainer: Trainer, s: TrainerSettings) -> bool:
    return trainer.step % s.publish_every == 0


def persist(
    trainer: Trainer, s: TrainerSettings, batch: TrainBatch, seq: int, r: StepResult
) -> None:
    """Save step `r.step`'s weights directory and its checkpoint (which records `seq`).

    From `r.snapshot` (one process) while the next step trains; otherwise
    from the live trainer, on every rank in step.
    """
    t = time.perf_counter()
    snap, r.snapshot = r.snapshot, None
    out = published_dir(s.weights_root, s.run, r.step)
    position = {"seq": seq, "batch_id": batch.batch_id}
    manifest = save_version(trainer, out, s.checkpoint_dir, position, snap)
    if trainer.info.is_main:
        prune_checkpoints(s.checkpoint_dir, s.keep_checkpoints)
    r.published = out
    if manifest is not None:
        r.sha256, r.size_bytes = manifest.sha256, manifest.total_bytes
    r.publish_s = time.perf_counter() - t


def save_version(
    trainer: Trainer,
    out: Path,
    checkpoint_dir: Path,
    position: dict[str, Any],
    snap: Snapshot | None,
) -> Manifest | None:
    """Weights directory `out` and the checkpoint at `position`, committed after `out` exists.

    From `snap` (one process), the directory is written on a thread while
    the checkpoint is staged: serialising, hashing and fsyncs overlap.
    """
    if snap is None:
        manifest = trainer.save_weights(out, overwrite=True)
        save_checkpoint(trainer, checkpoint_dir, position)
        return manifest
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="save-weights") as pool:
        weights = pool.submit(trainer.save_weights, out, overwrite=True, state_dict=snap.weights)
        staged = stage_checkpoint(trainer, checkpoint_dir, position, snap)
        manifest = weights.result()
    commit_checkpoint(staged)
    return manifest


def train_one(trainer: Trainer, s: TrainerSettings, batch: TrainBatch, seq: int) -> StepResult:
    """Train `batch` (stream sequence `seq`) and, when due, save weights + checkpoint."""
    r = compute_one(trainer, batch)
    if publish_due(trainer, s):
        persist(trainer, s, batch, seq, r)
    return r


def step(trainer: Trainer, s: TrainerSettings, batch: TrainBatch, seq: int) -> StepResult:
    """Rank 0: hand `batch` to every rank and train it; when due, a snapshot to persist
    later (one process) or the saving done in step (a collective under FSDP2)."""
    if trainer.info.world_size > 1:
        broadcast_bytes(encode(batch, max_payload=None), trainer.info)
        return train_one(trainer, s, batch, seq)
    r = compute_one(trainer, batch)
    if publish_due(trainer, s):
        r.snapshot = snapshot(trainer)
    return r


def follower_loop(trainer: Trainer, s: TrainerSettings) -> None:
    """Ranks > 0: train whatever rank 0 broadcasts until it says stop."""
    while (data := broadcast_bytes(None, trainer.info)) is not None:
        train_one(trainer, s, decode(data, TrainBatch), seq=-1)


def stop_followers(info: DistInfo) -> None:
    """Rank 0 is done: the other ranks' loops end."""
    broadcast_bytes(None, info)

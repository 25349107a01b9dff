"""torch.distributed set-up: one process, or torchrun with gloo (CPU) / nccl (GPU).

Whether we are distributed is read from torchrun's environment
(WORLD_SIZE/RANK/LOCAL_RANK); without it (or with WORLD_SIZE=1) nothing is
initialised and every collective helper below is a no-op, so the
single-process path never touches torch.distributed. `shard_single=True`
initialises the process group and shards with FSDP2 even for one rank
under torchrun (bench/trainer.py measures FSDP2's own cost that way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sharded_single: bool = False  # one rank, but a process group and FSDP2 all the same

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.sharded_single


def init_distributed(shard_single: bool = False) -> DistInfo:
    """Initialise the process group from torchrun's environment (idempotent)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    single = shard_single and world == 1 and "WORLD_SIZE" in os.environ
    if (world > 1 or single) and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return DistInfo(
        rank=rank, world_size=world, local_rank=local, device=device, sharded_single=single
    )


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce(t: torch.Tensor, info: DistInfo, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of a CPU tensor (moved to the collective's device and back)."""
    if not info.distributed:
        return t
    dev = info.device if dist.get_backend() == "nccl" else torch.device("cpu")
    x = t.to(dev)
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return x.to(t.device)


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()

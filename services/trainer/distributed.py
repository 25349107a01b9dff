"""torch.distributed set-up: one process, or torchrun with gloo (CPU) / nccl (GPU).

Whether we are distributed is read from torchrun's environment
(WORLD_SIZE/RANK/LOCAL_RANK); without it (or with WORLD_SIZE=1) nothing is
initialised and every collective helper below is a no-op, so the
single-process path never touches torch.distributed.
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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistInfo:
    """Initialise the process group from torchrun's environment (idempotent)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device)


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

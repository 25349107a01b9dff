"""Room on disk for what a service is about to write, asked before it writes.

A full disk otherwise shows up as whatever the writer says mid-file: torch's
zip writer `unexpected pos 509875968 vs 509875920`, safetensors `I/O error`,
a torn temporary directory left behind. Each writer that knows its size asks
`ensure_room` first, and turns a failure it meets anyway (another process
filled the disk meanwhile) into the same `DiskFullError` (`full_disk`).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

from services.runtime.errors import FlywheelError

# what a writer adds beyond its tensors (headers, JSON, the filesystem's own blocks)
SLACK_BYTES = 64 << 20


class DiskFullError(FlywheelError, OSError):
    """Not enough free space where something must be written; says how much is needed
    and how much there is."""

    def __init__(self, message: str, *, path: Path, need: int, free: int):
        super().__init__(errno.ENOSPC, message)
        self.path, self.need, self.free = path, need, free

    def __str__(self) -> str:
        return str(self.args[1])


def human(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB (a tiny model's checkpoint is a few MiB)."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a nested dict/list/tuple (a DTensor: this rank's shard)."""
    import torch

    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return int(local.numel() * local.element_size())
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def existing(path: Path) -> Path:
    """`path`, or its nearest existing parent: where a directory not yet made will live."""
    return next((p for p in [path, *path.parents] if p.exists()), Path.cwd())


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or will, once it is made)."""
    return shutil.disk_usage(existing(path)).free


def ensure_room(path: Path, need: int, what: str, hint: str = "") -> None:
    """DiskFullError unless `path`'s filesystem has `need` bytes (plus slack) free."""
    free = free_bytes(path)
    if free < need + SLACK_BYTES:
        raise full(path, need, free, what, hint)


def full(path: Path, need: int, free: int, what: str, hint: str = "") -> DiskFullError:
    msg = f"no room for {what} in {path}: it needs {human(need)}, {human(free)} free there"
    return DiskFullError(msg + (f" ({hint})" if hint else ""), path=path, need=need, free=free)


def full_disk(
    err: BaseException, path: Path, need: int, what: str, hint: str = ""
) -> DiskFullError | None:
    """The DiskFullError to raise from `err` when the disk under `path` is what failed, else
    None: ENOSPC, a writer that says so in words (safetensors: "No space left on device (os
    error 28)", not an OSError), or one that says nothing of it (torch's zip writer) with
    less free than `need`. Ask before removing what the failed write left: it is counted."""
    free = free_bytes(path)
    said = getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)
    return full(path, need, free, what, hint) if said or free < need + SLACK_BYTES else None

"""Durable writes: a file's data, or a directory's entries, on disk before a rename names it."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Make a file's data (or a directory's entries) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

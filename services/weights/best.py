"""The best evaluated weights: `<checkpoint_dir>/best/`, the published version
whose validation accuracy is the highest so far, with `best.json` beside it
(chosen on validation only: the test split reports, services/tasks/).

A run stopped on a target accuracy or a wall clock ends a step or more after
the evaluation that met it, and sync keeps only the last few versions, so
without this the weights that scored are gone when the run ends. The copy is
hard links where the filesystem allows (a published version's files are
never written again), so keeping it costs no space while that version lives.
The initial policy (the step-0 evaluation) is the user's own directory and is
not copied: `best/` holds trained weights only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

BEST_DIR = "best"
BEST_FILE = "best.json"


def best_record(checkpoint_dir: Path) -> dict[str, Any] | None:
    """{"step", "accuracy", "weights"} of the best evaluation kept, or None."""
    path = checkpoint_dir / BEST_FILE
    if not path.is_file() or not (checkpoint_dir / BEST_DIR).is_dir():
        return None  # none yet, or a crash between its two renames
    return dict(json.loads(path.read_text()))


def keep_if_best(checkpoint_dir: Path, published: Path, step: int, accuracy: float) -> bool:
    """Copy `published` to `best/` when `accuracy` beats the best kept (ties keep the older)."""
    kept = best_record(checkpoint_dir)
    if kept is not None and accuracy <= float(kept["accuracy"]):
        return False
    target = checkpoint_dir / BEST_DIR
    tmp = checkpoint_dir / f".{BEST_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(published, tmp, copy_function=link_or_copy)
    old = checkpoint_dir / f".{BEST_DIR}.old"
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    record = {"step": step, "accuracy": accuracy, "weights": str(target)}
    (checkpoint_dir / f"{BEST_FILE}.tmp").write_text(json.dumps(record))
    (checkpoint_dir / f"{BEST_FILE}.tmp").replace(checkpoint_dir / BEST_FILE)
    return True


def link_or_copy(src: str, dst: str) -> None:
    """A hard link; a copy where links cannot be made (another filesystem)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)

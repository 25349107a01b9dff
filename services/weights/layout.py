"""Where weight versions live on disk: one directory per version, `v000012`.

The trainer publishes version 12 of run `demo` as `<root>/demo/v000012/`;
an engine that receives its versions over the wire keeps them as
`<its local dir>/v000012/`. Every reader and writer of those names (the
trainer, sync's clean-up, the rollout worker's local copies, `flywheel
demo` and `eval`) goes through these functions, so the format is written
in one place.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def version_name(version: int) -> str:
    """`v000012`: zero-padded so that names sort like versions."""
    return f"v{version:06d}"


def version_of(name: str) -> int | None:
    """The version a directory name stands for (`v000012` → 12), None for any other name."""
    digits = name[1:]
    return int(digits) if name.startswith("v") and digits.isdigit() else None


def version_dir(parent: str | Path, version: int) -> Path:
    """`<parent>/v000012`."""
    return Path(parent) / version_name(version)


def published_dir(root: Path, run: str, version: int) -> Path:
    """Where the trainer writes a version of `run`: `<root>/<run>/v000012`."""
    return version_dir(root / run, version)


def versions_in(parent: Path) -> list[int]:
    """The versions that have a directory in `parent`, oldest first (none if it is absent)."""
    if not parent.is_dir():
        return []
    found = (version_of(p.name) for p in parent.iterdir() if p.is_dir())
    return sorted(v for v in found if v is not None)


def remove_versions(parent: Path, versions: list[int]) -> list[Path]:
    """Delete those versions' directories; returns the ones that were there."""
    removed = []
    for v in versions:
        path = version_dir(parent, v)
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(path)
    return removed

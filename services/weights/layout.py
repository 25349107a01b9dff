"""Where weight versions live on disk: one directory per version, `v000012`.

The trainer publishes version 12 of run `demo` as `<root>/demo/v000012/`;
an engine that receives its versions over the wire keeps them as
`<its local dir>/v000012/`. Every reader and writer of those names (the
trainer, sync's clean-up, the rollout worker's local copies, `flywheel
demo` and `eval`) goes through these functions, so the format is written
in one place (the names themselves: proto/weight_version.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from proto.weight_version import dir_name, parse_name


def version_dir(parent: str | Path, version: int) -> Path:
    """`<parent>/v000012`."""
    return Path(parent) / dir_name(version)


def published_dir(root: Path, run: str, version: int) -> Path:
    """Where the trainer writes a version of `run`: `<root>/<run>/v000012`."""
    return version_dir(root / run, version)


def versions_in(parent: Path) -> list[int]:
    """The versions that have a directory in `parent`, oldest first (none if it is absent)."""
    if not parent.is_dir():
        return []
    found = (parse_name(p.name) for p in parent.iterdir() if p.is_dir())
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

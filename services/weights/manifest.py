"""The weights-directory format shared by the trainer, the engines and sync.

A weights directory is an ordinary Hugging Face model directory (config.json,
*.safetensors, tokenizer files, generation_config.json, …) plus one file,
`flywheel-manifest.json`, written last:

    {
      "format": "flywheel-weights/1",
      "files": [{"name": "config.json", "size": 712, "sha256": "<hex>"}, ...],
      "total_bytes": 2148213,
      "sha256": "<hex>"
    }

- `files` lists every regular file in the directory (recursively, names
  relative with "/" separators) except the manifest itself, sorted by name.
- `total_bytes` is the sum of their sizes.
- `sha256` (the directory digest that `WeightsPublished` carries) is the
  SHA-256 of the UTF-8 text made of one line per file, in name order:
  `"<name> <sha256 hex>\\n"`. Two directories with the same files and bytes
  have the same digest, wherever they live.

Writing is atomic: the content goes into a temporary directory beside the
target (same filesystem), every file and the directory are fsynced, the
manifest is written, and the temporary directory is renamed onto the
target. A reader therefore sees either no directory or a complete one, and
`verify_weights_dir` detects anything altered afterwards.

This module imports no torch: engines and sync use it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.runtime.diskroom import ensure_room, full_disk
from services.runtime.durable import (
    fsync_path as _fsync_path,  # bench/version_cost.py times it by this name
)
from services.runtime.errors import FlywheelError

MANIFEST_NAME = "flywheel-manifest.json"
FORMAT = "flywheel-weights/1"
_CHUNK = 1 << 20
ROOM_HINT = "free space there, or point the weights directory at a larger disk"


class WeightsError(FlywheelError, OSError):
    """A weights directory is missing, incomplete or corrupt."""

    def __init__(self, message: str, *, path: Path, file: str | None = None):
        super().__init__(message)
        self.path = path
        self.file = file


class ManifestMissingError(WeightsError):
    """The directory has no (readable, valid) manifest."""


class WeightsFileMissingError(WeightsError):
    """A file listed in the manifest is absent."""


class WeightsMismatchError(WeightsError):
    """A file's size or sha256, or the directory digest, differs from the manifest."""


class WeightsExistsError(WeightsError, FileExistsError):
    """The target directory exists and overwrite was not requested."""


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileEntry, ...]
    total_bytes: int
    sha256: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "files": [vars(f) for f in self.files],
                "total_bytes": self.total_bytes,
                "sha256": self.sha256,
            },
            indent=2,
        )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def directory_digest(files: tuple[FileEntry, ...] | list[FileEntry]) -> str:
    """SHA-256 over the sorted "<name> <sha256>\\n" lines (see the module docstring)."""
    lines = "".join(f"{f.name} {f.sha256}\n" for f in sorted(files, key=lambda f: f.name))
    return hashlib.sha256(lines.encode()).hexdigest()


def _content_files(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).as_posix() != MANIFEST_NAME
    )


def build_manifest(root: str | Path) -> Manifest:
    """Hash every file under `root` (except the manifest) into a Manifest."""
    root = Path(root)
    entries = tuple(
        FileEntry(p.relative_to(root).as_posix(), p.stat().st_size, file_sha256(p))
        for p in _content_files(root)
    )
    return Manifest(entries, sum(e.size for e in entries), directory_digest(entries))


def write_weights_dir(
    target: str | Path,
    write: Callable[[Path], None],
    *,
    overwrite: bool = False,
    need: int = 0,
) -> Manifest:
    """Atomically create `target` with whatever `write(tmp_dir)` puts in it, plus a manifest.

    With `overwrite`, an existing target is replaced: the new directory is
    complete before the old one is moved aside (readers of the old path see
    old-complete or new-complete, never partial). `need`: the bytes `write`
    will put there, if known; a DiskFullError before writing, or when the
    disk fills meanwhile, instead of the writer's own words.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise WeightsExistsError(f"weights directory already exists: {target}", path=target)
    target.parent.mkdir(parents=True, exist_ok=True)
    what = f"weights {target.name}"
    if need:
        ensure_room(target.parent, need, what, ROOM_HINT)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        manifest = build_manifest(tmp)
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
        for p in [*_content_files(tmp), tmp / MANIFEST_NAME]:
            _fsync_path(p)
        _fsync_path(tmp)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
        os.rename(tmp, target)
        _fsync_path(target.parent)
    except BaseException as e:
        disk = full_disk(e, target.parent, need, what, ROOM_HINT) if need else None
        shutil.rmtree(tmp, ignore_errors=True)
        if disk is not None and isinstance(e, Exception):
            raise disk from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def read_manifest(path: str | Path) -> Manifest:
    """Parse `path`/flywheel-manifest.json (no hashing); ManifestMissingError if absent/bad."""
    root = Path(path)
    mpath = root / MANIFEST_NAME
    try:
        doc = json.loads(mpath.read_text())
    except FileNotFoundError as e:
        raise ManifestMissingError(
            f"no {MANIFEST_NAME} in {root}", path=root, file=MANIFEST_NAME
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestMissingError(
            f"{mpath} is not valid JSON: {e}", path=root, file=MANIFEST_NAME
        ) from e
    try:
        if doc["format"] != FORMAT:
            raise ManifestMissingError(
                f"{mpath}: unknown format {doc['format']!r}", path=root, file=MANIFEST_NAME
            )
        files = tuple(
            FileEntry(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in doc["files"]
        )
        return Manifest(files, int(doc["total_bytes"]), str(doc["sha256"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestMissingError(
            f"{mpath}: malformed manifest ({e!r})", path=root, file=MANIFEST_NAME
        ) from e


def verify_weights_dir(
    path: str | Path, hashed: Mapping[str, str] | None = None, *, sizes_only: bool = False
) -> Manifest:
    """Check every file against the manifest; return it, or raise a WeightsError naming the file.

    Extra files not in the manifest are ignored (an engine may add caches).
    `hashed` maps file names to sha256 digests the caller computed over the
    very bytes it wrote (the NATS receiver hashes chunks as they arrive);
    those files are not read again, which saves a full pass over the weights.
    `sizes_only` checks presence and sizes but reads no file (for a reader
    that trusts how the directory got there: see the engine's `weights_check`).
    """
    hashed = hashed or {}
    root = Path(path)
    if not root.is_dir():
        raise WeightsError(f"weights directory not found: {root}", path=root)
    manifest = read_manifest(root)
    for entry in manifest.files:
        p = root / entry.name
        if not p.is_file():
            raise WeightsFileMissingError(
                f"{root}: missing file {entry.name}", path=root, file=entry.name
            )
        size = p.stat().st_size
        if size != entry.size:
            raise WeightsMismatchError(
                f"{root}: {entry.name} has {size} bytes, manifest says {entry.size}",
                path=root,
                file=entry.name,
            )
        if sizes_only:
            continue
        digest = hashed.get(entry.name) or file_sha256(p)
        if digest != entry.sha256:
            raise WeightsMismatchError(
                f"{root}: {entry.name} sha256 differs from the manifest", path=root, file=entry.name
            )
    if directory_digest(manifest.files) != manifest.sha256:
        raise WeightsMismatchError(
            f"{root}: directory digest differs from the manifest", path=root, file=MANIFEST_NAME
        )
    return manifest

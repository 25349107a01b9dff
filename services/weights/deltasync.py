"""Deltas around the pure codec (delta.py): the trainer writes them, a receiver rebuilds.

Trainer (`DeltaWriter`): it keeps the bytes of the version it published
last; for the next one it writes the delta beside the full directory
(`<root>/<run>/v000012.delta/`, an ordinary weights directory holding
`delta.msgpack`), and says whether this version is also a full snapshot:
the first after a start (nothing to diff against), then every
`snapshot_every` versions, so that an engine that joins late (or missed
versions) needs the last snapshot plus the deltas after it.

Receiver (`rebuild`): the chain of deltas is hash-linked. Each delta names
its base version and that base's directory digest, and carries the new
version's manifest; walking back from the announced version (whose digest
`WeightsPublished` carries) through the deltas reaches either the version
the engine holds (its local copy's manifest must have the digest the chain
expects) or the announced snapshot (downloaded in full). The deltas are
then applied in memory and the result is written only if every file's
sha256 and the directory digest equal the trainer's manifest. Anything
else (a missing or corrupt chunk, a stale delta, a broken chain) raises,
and the transport falls back to a full download of the version: an
engine gets the exact weights or none.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.weights.base import WeightsTransferError
from services.weights.delta import Delta, DeltaError, DeltaStats, apply, encode, unpack
from services.weights.layout import version_dir
from services.weights.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    WeightsError,
    WeightsMismatchError,
    directory_digest,
    read_manifest,
    write_weights_dir,
)

log = logging.getLogger(__name__)

DELTA_FILE = "delta.msgpack"


def delta_dir(full_dir: Path) -> Path:
    """Where the delta into a version lives: beside its full directory."""
    return full_dir.parent / f"{full_dir.name}.delta"


def read_files(directory: Path) -> dict[str, bytes]:
    """Every file of a weights directory but its manifest: relative name → bytes."""
    paths = (p for p in sorted(directory.rglob("*")) if p.is_file())
    named = ((p.relative_to(directory).as_posix(), p) for p in paths)
    return {name: p.read_bytes() for name, p in named if name != MANIFEST_NAME}


@dataclass(frozen=True)
class Prepared:
    """What the trainer sends for one version: maybe a delta, maybe a full snapshot."""

    version: int
    snapshot: int  # the newest full snapshot at or below this version
    full: bool  # this version is itself a snapshot (sent whole)
    delta: Path | None  # the delta directory (None: nothing to diff against)
    stats: DeltaStats | None
    encode_s: float


@dataclass
class _Base:
    version: int
    sha256: str
    files: dict[str, bytes]


class DeltaWriter:
    """Trainer: the delta of each published version against the one before (module doc)."""

    def __init__(self, snapshot_every: int) -> None:
        self.snapshot_every = snapshot_every
        self._base: _Base | None = None
        self._snapshot: int | None = None
        self._since_snapshot = 0

    def prepare(self, version: int, directory: Path) -> Prepared:
        """Write the delta beside `directory` (blocking: run it in a thread)."""
        t = time.perf_counter()
        manifest_text = (directory / MANIFEST_NAME).read_text()
        sha256 = read_manifest(directory).sha256
        files = read_files(directory)
        base = self._base
        out, stats = None, None
        if base is not None and base.version < version:
            packed, stats = encode(
                base.files,
                files,
                version=version,
                base_version=base.version,
                base_sha256=base.sha256,
                manifest=manifest_text,
            )
            out = delta_dir(directory)

            def write(tmp: Path) -> None:
                (tmp / DELTA_FILE).write_bytes(packed)

            write_weights_dir(out, write, overwrite=True, need=len(packed))
        full = self._snapshot is None or self._since_snapshot + 1 >= self.snapshot_every
        if full or out is None:
            self._snapshot, self._since_snapshot, full = version, 0, True
        else:
            self._since_snapshot += 1
        self._base = _Base(version, sha256, files)
        assert self._snapshot is not None
        return Prepared(version, self._snapshot, full, out, stats, time.perf_counter() - t)


class DeltaSource(Protocol):
    """Where a receiver gets deltas and full versions (NATS or the shared disk)."""

    async def delta(self, version: int) -> bytes:
        """The packed delta into `version`; WeightsTransferError if it cannot be had."""
        ...

    async def full(self, version: int, sha256: str, target: Path) -> int:
        """Bring the full version into `target`, verified against `sha256`; bytes moved."""
        ...


@dataclass(frozen=True)
class Rebuilt:
    version: int
    deltas: int  # deltas applied (0: a full download)
    bytes: int  # bytes moved to get here
    rebuild_s: float  # time applying deltas and writing the directory


def _manifest_digest(delta: Delta) -> str:
    try:
        return str(json.loads(delta.manifest)["sha256"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DeltaError(f"v{delta.version}: malformed manifest in the delta") from e


async def _chain(
    src: DeltaSource, version: int, sha256: str, stop: int, budget: int
) -> tuple[list[Delta], int]:
    """The deltas from `stop` to `version`, newest first, each linked by digest to the next;
    and their packed size. More than `budget` bytes of them: a full copy is cheaper."""
    chain: list[Delta] = []
    size = 0
    k, want = version, sha256
    while k != stop:
        if k < stop:
            raise DeltaError(f"v{version}: the deltas pass v{stop} by (at v{k})")
        packed = await src.delta(k)
        size += len(packed)
        if size > budget:
            raise DeltaError(f"v{version}: the deltas back to v{stop} outgrow a full copy")
        d = unpack(packed)
        if d.version != k or _manifest_digest(d) != want:
            raise DeltaError(f"v{k}: the delta found is not the one this version chains to")
        chain.append(d)
        k, want = d.base_version, d.base_sha256
    return chain, size


def _check_rebuilt(
    files: Mapping[str, bytes | bytearray], manifest_text: str, sha256: str, target: Path
) -> None:
    """The rebuilt files are the trainer's exactly: every sha256, the digest, the manifest."""
    entries = tuple(
        FileEntry(name, len(data), hashlib.sha256(data).hexdigest())
        for name, data in sorted(files.items())
    )
    got = Manifest(entries, sum(e.size for e in entries), directory_digest(entries))
    if got.sha256 != sha256 or got.to_json() != manifest_text:
        raise WeightsMismatchError(
            f"{target.name}: rebuilt weights differ from the trainer's", path=target
        )


def _write_rebuilt(
    files: Mapping[str, bytes | bytearray], manifest_text: str, target: Path, sha256: str
) -> None:
    """Write the rebuilt files into `target` (atomically) if they are the trainer's exactly
    (hashed in memory: the bytes written are the bytes checked)."""
    _check_rebuilt(files, manifest_text, sha256, target)
    tmp = target.parent / f".{target.name}.rebuild-{uuid.uuid4().hex[:8]}"
    try:
        for name, data in files.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (tmp / MANIFEST_NAME).write_text(manifest_text)
        if not target.is_dir():
            os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def rebuild(
    src: DeltaSource,
    version: int,
    sha256: str,
    snapshot: int,
    into: Path,
    held: int | None,
    full_bytes: int,
) -> Rebuilt:
    """Bring `version` into `into`/v… from the held copy (or the snapshot) plus deltas.

    `held` is the newest version already verified in `into` (None: none);
    the deltas from it are tried first (even past a newer snapshot: they are
    smaller) while they weigh less than the version's `full_bytes`, then
    the snapshot's. Raises DeltaError, WeightsError or WeightsTransferError
    when no chain can be followed or the result is not the trainer's.
    """
    target = version_dir(into, version)
    if held is not None and held < version:
        try:
            chain, moved = await _chain(src, version, sha256, held, full_bytes)
            if read_manifest(version_dir(into, held)).sha256 != chain[-1].base_sha256:
                raise DeltaError(f"v{version}: the held v{held} is not the base of its deltas")
            return await _apply(chain, version_dir(into, held), target, sha256, moved)
        except (DeltaError, WeightsError, WeightsTransferError) as e:
            if snapshot <= held:
                raise
            log.info("v%d: no deltas from the held v%d (%s); from the snapshot", version, held, e)
    if snapshot == version:  # the announced version is itself the snapshot
        return Rebuilt(version, 0, await src.full(version, sha256, target), 0.0)
    chain, moved = await _chain(src, version, sha256, snapshot, full_bytes)
    base_dir = version_dir(into, snapshot)
    moved += await src.full(snapshot, chain[-1].base_sha256, base_dir)
    return await _apply(chain, base_dir, target, sha256, moved)


async def _apply(
    chain: list[Delta], base_dir: Path, target: Path, sha256: str, moved: int
) -> Rebuilt:
    t = time.perf_counter()

    def build() -> None:
        files: dict[str, bytes | bytearray] = dict(read_files(base_dir))
        for d in reversed(chain):
            files = apply(files, d)
        _write_rebuilt(files, chain[0].manifest, target, sha256)

    await asyncio.to_thread(build)
    return Rebuilt(chain[0].version, len(chain), moved, time.perf_counter() - t)

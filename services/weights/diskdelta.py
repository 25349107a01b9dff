"""The shared-disk delta transport: engines read the small delta files, not every full version.

`[trainer] weights_transport = "disk-delta"`. The trainer writes every
version's full directory as always, and beside it the delta against the
version before (`v000012.delta/`, deltasync.py). It announces
`filedelta:///<root>/<run>/v000012`. Beside each engine, `receive` rebuilds
the version in the engine's local directory from the copy it holds plus
the delta files after it, verified against the trainer's manifest; with no
copy yet, or when anything in the chain is missing or wrong, it copies the
full directory (verified too). On shared storage that turns "every engine
reads the whole model every version" into "every engine reads the delta".

A message off the bus must not make a worker read an arbitrary directory:
the announced path must be `<…>/<run>/v<digits>` for this run, and what it
reads is used only if its sha256 is the trainer's.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import urlparse

from proto.weight_version import dir_name, parse_name
from services.weights.base import (
    BadWeightsUri,
    LocalCopy,
    Sent,
    Transfer,
    WeightsTransferError,
    Wiring,
)
from services.weights.delta import DeltaError
from services.weights.deltasync import DELTA_FILE, DeltaWriter, delta_dir, rebuild
from services.weights.layout import version_dir
from services.weights.manifest import WeightsError, verify_weights_dir

if TYPE_CHECKING:
    from proto.messages import WeightsPublished

log = logging.getLogger(__name__)

SCHEME = "filedelta"


def run_dir_of(uri: str, run: str, version: int) -> Path:
    """The trainer's run directory a `filedelta://` URI names; BadWeightsUri otherwise."""
    p = urlparse(uri)
    path = Path(p.path)
    if p.scheme != SCHEME or path.name != dir_name(version) or path.parent.name != run:
        raise BadWeightsUri(f"weights uri {uri!r} is not {SCHEME}:///…/{run}/v<version>")
    return path.parent


def copy_verified(src: Path, sha256: str, target: Path) -> int:
    """Copy a full version directory into `target` (atomically) if it is the trainer's."""
    tmp = target.parent / f".{target.name}.copy-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(src, tmp)
        manifest = verify_weights_dir(tmp)
        if manifest.sha256 != sha256:
            raise WeightsTransferError(f"{src}: not the announced weights", version=-1)
        if not target.is_dir():
            tmp.rename(target)
        return manifest.total_bytes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class DiskDeltaSource:
    """deltasync.DeltaSource over the shared run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    async def delta(self, version: int) -> bytes:
        d = delta_dir(version_dir(self.run_dir, version))

        def read() -> bytes:
            verify_weights_dir(d)
            return (d / DELTA_FILE).read_bytes()

        try:
            return await asyncio.to_thread(read)
        except WeightsError as e:
            raise WeightsTransferError(f"v{version}: no usable delta: {e}", version=version) from e

    async def full(self, version: int, sha256: str, target: Path) -> int:
        src = version_dir(self.run_dir, version)
        return await asyncio.to_thread(copy_verified, src, sha256, target)


class DiskDeltaTransport:
    kind: ClassVar[str] = "disk-delta"
    scheme: ClassVar[str] = SCHEME

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        # Every full directory stays on disk: no version is a snapshot to send.
        self.writer = DeltaWriter(snapshot_every=1 << 30)

    async def publish(self, version: int, directory: Path) -> Sent:
        prep = await asyncio.to_thread(self.writer.prepare, version, directory)
        sent = Transfer(version, 0, prep.stats.delta_bytes if prep.stats else 0, prep.encode_s)
        return Sent(f"{SCHEME}://{directory.resolve()}", sent, prep.stats)

    def source(self, uri: str, version: int) -> LocalCopy:
        run_dir_of(uri, self.wiring.run, version)
        return LocalCopy(version)

    async def receive(
        self, msg: WeightsPublished, into: Path, newer_than: int | None
    ) -> Transfer | None:
        version = msg.version
        run_dir = run_dir_of(msg.uri, self.wiring.run, version)
        if newer_than is not None and version <= newer_than:
            return None
        src = DiskDeltaSource(run_dir)
        started = asyncio.get_running_loop().time()
        if newer_than is not None:
            try:
                got = await rebuild(
                    src, version, msg.sha256, version, into, newer_than, msg.size_bytes
                )
                seconds = asyncio.get_running_loop().time() - started
                return Transfer(version, 0, got.bytes, seconds, got.deltas, got.rebuild_s)
            except (DeltaError, WeightsError, WeightsTransferError) as e:
                log.warning("rollout: v%d from deltas failed (%s); copying it whole", version, e)
        target = version_dir(into, version)
        if target.exists():
            shutil.rmtree(target)
        moved = await src.full(version, msg.sha256, target)
        return Transfer(version, 0, moved, asyncio.get_running_loop().time() - started)

    async def cleanup(self, below: int) -> None:
        """The delta files below the floor (the full directories: `Transports.cleanup`)."""
        if self.wiring.root is None:
            return
        for p in (self.wiring.root / self.wiring.run).glob("v*.delta"):
            v = parse_name(p.name.removesuffix(".delta"))
            if v is not None and v < below:
                shutil.rmtree(p, ignore_errors=True)

"""The NATS delta transport: per version only the elements that changed, and snapshots.

`[trainer] weights_transport = "nats-delta"`. Per version the trainer
uploads the delta against the version before (deltasync.py) as the chunks
of its delta directory on `weightdata.d<version>`, and, every
`weights_snapshot_every` versions (and for the first after a start), the
full directory on `weightdata.v<version>` as the `nats` transport does. It
announces `natsdelta://<WEIGHTDATA stream>/<version>?snapshot=<S>`, S being
the newest full snapshot.

Beside each engine, `receive` rebuilds the version from the engine's copy
(or snapshot S) plus the deltas after it, verified byte for byte against
the trainer's manifest (deltasync.rebuild). When that fails for any reason,
it downloads the version in full: the snapshot's chunks if the version is
one, else it asks the trainer (core request/reply on `weightsnap`) to
upload that version whole, *on demand*, then downloads it. The trainer
answers from its published directory; a version it no longer has is an
error, and the worker tries again with the next announcement.

`cleanup` keeps, in the stream, the newest snapshot at or below the floor
and everything after it (what a late joiner and every live engine still
need), and drops the delta directories below it on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import parse_qs, urlparse

from proto.streams import stream_name
from proto.subjects import Subjects
from proto.weight_version import parse_name
from services.weights.base import (
    BadWeightsUri,
    LocalCopy,
    Sent,
    Transfer,
    WeightsTransferError,
    Wiring,
)
from services.weights.chunks import download, purge, upload
from services.weights.delta import DeltaError
from services.weights.deltasync import (
    DELTA_FILE,
    DeltaWriter,
    delta_dir,
    rebuild,
)
from services.weights.layout import published_dir, version_dir
from services.weights.manifest import WeightsError

if TYPE_CHECKING:
    from proto.messages import WeightsPublished

log = logging.getLogger(__name__)

SCHEME = "natsdelta"


def delta_uri(run: str, version: int, snapshot: int) -> str:
    return f"{SCHEME}://{stream_name(run, 'WEIGHTDATA')}/{version}?snapshot={snapshot}"


def parse_delta_uri(uri: str) -> tuple[int, int]:
    """(version, snapshot) of a `natsdelta://` URI; BadWeightsUri if it is not one."""
    p = urlparse(uri)
    version, snapshot = p.path.lstrip("/"), parse_qs(p.query).get("snapshot", [""])[0]
    if p.scheme != SCHEME or not p.netloc or not version.isdigit() or not snapshot.isdigit():
        raise BadWeightsUri(f"weights uri {uri!r} is not {SCHEME}://<stream>/<v>?snapshot=<s>")
    if int(snapshot) > int(version):
        raise BadWeightsUri(f"weights uri {uri!r}: snapshot after the version")
    return int(version), int(snapshot)


class NatsDeltaSource:
    """deltasync.DeltaSource over JetStream: delta and full chunks, and on-demand fulls."""

    def __init__(self, wiring: Wiring) -> None:
        self.w = wiring
        self.subjects = Subjects(wiring.run)

    async def _present(self, subject: str, version: int) -> None:
        """Fail at once (not after the idle timeout) when nothing is stored on `subject`."""
        info = await self.w.js.stream_info(
            stream_name(self.w.run, "WEIGHTDATA"), subjects_filter=subject
        )
        if not (info.state.subjects or {}).get(subject):
            raise WeightsTransferError(f"v{version}: nothing on {subject}", version=version)

    async def delta(self, version: int) -> bytes:
        subject = self.subjects.weightdelta(version)
        await self._present(subject, version)
        with tempfile.TemporaryDirectory(prefix="flywheel-delta-") as tmp:
            target = Path(tmp) / "d"
            await download(
                self.w.js,
                self.w.run,
                version,
                None,  # the first publication; the chain checks what it rebuilds
                target,
                idle_timeout_s=self.w.idle_timeout_s,
                subject=subject,
            )
            return await asyncio.to_thread((target / DELTA_FILE).read_bytes)

    async def full(self, version: int, sha256: str, target: Path) -> int:
        await self._present(self.subjects.weightdata(version), version)
        t = await download(
            self.w.js, self.w.run, version, sha256, target, idle_timeout_s=self.w.idle_timeout_s
        )
        return t.bytes

    async def on_demand(self, version: int, sha256: str, target: Path) -> int:
        """Ask the trainer to upload `version` whole, then download it."""
        from nats.errors import Error as NatsError

        try:
            reply = await self.w.nc.request(
                self.subjects.weights_snapshot, str(version).encode(), timeout=self.w.idle_timeout_s
            )
        except (NatsError, TimeoutError) as e:
            raise WeightsTransferError(
                f"v{version}: no full upload on demand: {e!r}", version=version
            ) from e
        if reply.data != b"ok":
            raise WeightsTransferError(
                f"v{version}: trainer refused a full upload: {reply.data[:200]!r}", version=version
            )
        return await self.full(version, sha256, target)


class NatsDeltaTransport:
    kind: ClassVar[str] = "nats-delta"
    scheme: ClassVar[str] = SCHEME

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.run = wiring.run
        self.subjects = Subjects(wiring.run)
        self.writer = DeltaWriter(wiring.snapshot_every)
        self._serving: Any = None
        self._uploads: dict[int, asyncio.Future[Transfer]] = {}
        self.served: list[int] = []  # versions uploaded whole on demand (for tests, logs)

    # -- trainer ----------------------------------------------------------------------

    async def _upload(self, version: int, directory: Path, subject: str | None = None) -> Transfer:
        w = self.wiring
        return await upload(
            w.js,
            self.run,
            version,
            directory,
            max_payload=w.max_payload,
            window=w.upload_window,
            subject=subject,
        )

    async def publish(self, version: int, directory: Path) -> Sent:
        await self._serve()
        prep = await asyncio.to_thread(self.writer.prepare, version, directory)
        sent: list[Transfer] = []
        if prep.delta is not None:
            sent.append(await self._upload(version, prep.delta, self.subjects.weightdelta(version)))
        if prep.full:
            sent.append(await self._upload(version, directory))
        total = Transfer(
            version,
            sum(t.chunks for t in sent),
            sum(t.bytes for t in sent),
            sum(t.seconds for t in sent) + prep.encode_s,
        )
        return Sent(delta_uri(self.run, version, prep.snapshot), total, prep.stats)

    async def _serve(self) -> None:
        """Answer receivers' requests for a full version (once, on the first publish)."""
        if self._serving is not None or self.wiring.nc is None:
            return
        self._serving = await self.wiring.nc.subscribe(
            self.subjects.weights_snapshot, cb=self._on_request
        )

    async def _on_request(self, msg: Any) -> None:
        from nats.errors import Error as NatsError

        try:
            version = int(msg.data)
            directory = published_dir(self._root(), self.run, version)
            if not directory.is_dir():
                raise WeightsTransferError(f"v{version} is no longer published", version=version)
            task = self._uploads.get(version)
            if task is None:  # several engines asking at once: one upload
                task = self._uploads[version] = asyncio.ensure_future(
                    self._upload(version, directory)
                )
                task.add_done_callback(lambda _t: self._uploads.pop(version, None))
                self.served.append(version)
            await task
            log.info("trainer: uploaded v%d whole on demand", version)
            await msg.respond(b"ok")
        except (ValueError, OSError, WeightsTransferError, NatsError, TimeoutError) as e:
            log.warning("trainer: cannot upload a version on demand: %r", e)
            with contextlib.suppress(NatsError):  # the asker times out and tries again
                await msg.respond(f"error: {e}".encode())

    def _root(self) -> Path:
        if self.wiring.root is None:
            raise ValueError("the nats-delta weights transport needs the weights root")
        return self.wiring.root

    # -- sync and receivers -------------------------------------------------------------

    def source(self, uri: str, version: int) -> LocalCopy:
        parse_delta_uri(uri)
        return LocalCopy(version)

    async def receive(
        self, msg: WeightsPublished, into: Path, newer_than: int | None
    ) -> Transfer | None:
        version, snapshot = parse_delta_uri(msg.uri)
        if newer_than is not None and version <= newer_than:
            return None
        src = NatsDeltaSource(self.wiring)
        started = asyncio.get_running_loop().time()
        try:
            got = await rebuild(
                src, version, msg.sha256, snapshot, into, newer_than, msg.size_bytes
            )
            seconds = asyncio.get_running_loop().time() - started
            return Transfer(version, 0, got.bytes, seconds, got.deltas, got.rebuild_s)
        except (DeltaError, WeightsError, WeightsTransferError) as e:
            log.warning("rollout: v%d from deltas failed (%s); downloading it whole", version, e)
        target = version_dir(into, version)
        if target.exists():  # a rebuild that verified but failed afterwards: start clean
            shutil.rmtree(target)
        moved = await (src.full if version == snapshot else src.on_demand)(
            version, msg.sha256, target
        )
        return Transfer(version, 0, moved, asyncio.get_running_loop().time() - started)

    async def cleanup(self, below: int) -> None:
        from nats.errors import Error as NatsError

        js = self.wiring.js
        try:
            info = await js.stream_info(
                stream_name(self.run, "WEIGHTDATA"), subjects_filter=self.subjects.weightdata_all
            )
            held = [s.rsplit(".", 1)[-1] for s in info.state.subjects or {}]
            fulls = [v for v in (parse_name(t) for t in held) if v is not None]
            keep = max((v for v in fulls if v <= below), default=None)
            if keep is None:
                return
            for token in held:
                v = parse_name("v" + token[1:]) if token[:1] in ("v", "d") else None
                if v is not None and v < keep:
                    subject = f"{self.subjects.prefix}.weightdata.{token}"
                    await purge(js, self.run, v, subject)
            self._drop_delta_dirs(keep)
        except (NatsError, TimeoutError) as e:  # the stream's max_age is the backstop
            log.warning("sync: cannot purge old weight chunks: %r", e)

    def _drop_delta_dirs(self, below: int) -> None:
        if self.wiring.root is None:
            return
        run_dir = self.wiring.root / self.run
        for p in run_dir.glob("v*.delta"):
            v = parse_name(p.name.removesuffix(".delta"))
            if v is not None and v < below:
                shutil.rmtree(delta_dir(published_dir(self.wiring.root, self.run, v)))

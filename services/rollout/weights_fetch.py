"""The engine side of the weights transport: keep the newest version on local disk.

Beside each engine, the rollout worker watches the newest `WeightsPublished`
(the last message on `weights.published`, re-read every `weights_poll_s`
and at once when a new one is announced — so a worker that starts late, or
missed a message while disconnected, still finds the newest version) and
hands it to the transport its URI names, which brings it into
`<weights_dir>/<run>/<engine_id>/v000012/` when the engine needs a local
copy (NATS: downloaded, verified, renamed into place) and does nothing when
the engine reads a shared directory. Its heartbeats report that directory
and the newest version received; sync updates the engine only once the
version is there, with the engine-local path.

Local copies are not trusted across restarts (they are not fsynced): the
directory is emptied at start and the newest version is fetched again.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from proto.codec import decode
from proto.errors import ProtocolError
from proto.messages import WeightsPublished
from proto.streams import stream_name
from proto.subjects import Subjects
from services.rollout.core import prunable
from services.runtime.msgloop import pause
from services.weights import (
    BadWeightsUri,
    Transfer,
    Transports,
    WeightsTransferError,
    Wiring,
    versions_in,
)
from services.weights.layout import remove_versions

log = logging.getLogger(__name__)


class WeightsFetcher:
    def __init__(
        self,
        js: Any,
        nc: Any,
        run: str,
        local_dir: Path,
        *,
        poll_s: float,
        keep: int,
        idle_timeout_s: float,
        on_download: Callable[[Transfer], None] | None = None,
    ) -> None:
        self.js, self.nc = js, nc
        self.run = run
        self.subjects = Subjects(run)
        self.local_dir = local_dir.resolve()
        self.poll_s = poll_s
        self.keep = keep
        self.idle_timeout_s = idle_timeout_s
        self.on_download = on_download  # what each received version took, for metrics
        self.downloaded: int | None = None
        self.transports = Transports(Wiring(run, js=js, nc=nc, idle_timeout_s=idle_timeout_s))
        self._wake = asyncio.Event()

    def reset(self) -> None:
        """Start empty: copies from a previous life may be incomplete on disk."""
        if self.local_dir.exists():
            shutil.rmtree(self.local_dir)
        self.local_dir.mkdir(parents=True)

    def held(self) -> list[int]:
        return versions_in(self.local_dir)

    async def latest(self) -> WeightsPublished | None:
        from nats.js.errors import NotFoundError

        try:
            raw = await self.js.get_last_msg(
                stream_name(self.run, "WEIGHTS"), self.subjects.weights_published
            )
        except NotFoundError:
            return None
        try:
            return decode(raw.data or b"", WeightsPublished)
        except ProtocolError as e:
            log.warning("rollout: unreadable last WeightsPublished: %s", e)
            return None

    async def fetch_once(self) -> int | None:
        """Receive the newest published version if its transport needs a local copy of it."""
        msg = await self.latest()
        if msg is None:
            return None
        try:
            transport = self.transports.for_uri(msg.uri)
            got = await transport.receive(msg, self.local_dir, newer_than=self.downloaded)
        except BadWeightsUri as e:
            log.warning("rollout: %s", e)
            return None
        if got is None:
            return None
        self.downloaded = got.version
        log.info(
            "rollout: v%d received (%s, %d deltas): %.1f MB in %.2fs (%.0f MB/s)",
            got.version,
            transport.kind,
            got.deltas,
            got.bytes / 1e6,
            got.seconds,
            got.mb_per_s,
        )
        if self.on_download is not None:
            self.on_download(got)
        return got.version

    def prune(self, serving: int) -> None:
        remove_versions(self.local_dir, prunable(self.held(), serving, self.keep))

    async def run_loop(self, stop: asyncio.Event, serving: Callable[[], Awaitable[int]]) -> None:
        """Until `stop`: fetch what is new, prune what the engine no longer needs."""
        from nats.errors import Error as NatsError

        from services.engine_api.engine_client import EngineError

        self.reset()

        async def on_published(_msg: Any) -> None:
            self._wake.set()

        sub = await self.nc.subscribe(self.subjects.weights_published, cb=on_published)
        try:
            while not stop.is_set():
                self._wake.clear()
                try:
                    await self.fetch_once()
                    self.prune(await serving())
                except (WeightsTransferError, NatsError, EngineError, OSError, TimeoutError) as e:
                    # NATS reconnecting, engine restarting, a bad download: try again later.
                    log.warning("rollout: weights fetch failed (will retry): %r", e)
                await pause(stop, self.poll_s, self._wake)
        finally:
            await sub.unsubscribe()

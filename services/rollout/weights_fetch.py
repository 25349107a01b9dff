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

A version that fails to arrive `max_attempts` times running (its chunks
gone, corrupt, or never complete) is given up: reported once as an error and
in `flywheel_rollout_weights_given_up_total`, then left alone until a newer
version is published (it used to be downloaded again every poll, forever).
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
from services.runtime.missing import not_found_missing
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
        max_attempts: int = 5,
        on_download: Callable[[Transfer], None] | None = None,
        on_give_up: Callable[[int], None] | None = None,
    ) -> None:
        self.js, self.nc = js, nc
        self.run = run
        self.subjects = Subjects(run)
        self.local_dir = local_dir.resolve()
        self.poll_s = poll_s
        self.keep = keep
        self.idle_timeout_s = idle_timeout_s
        self.max_attempts = max_attempts
        self.on_download = on_download  # what each received version took, for metrics
        self.on_give_up = on_give_up  # a version given up, for metrics
        self.downloaded: int | None = None
        self.given_up: int | None = None  # the newest version given up (skipped from now on)
        self._failures: tuple[int, int] = (0, 0)  # (version, failed attempts in a row)
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

        stream = stream_name(self.run, "WEIGHTS")
        try:
            raw = await self.js.get_last_msg(stream, self.subjects.weights_published)
        except NotFoundError as e:  # no version yet; or no stream (then: stop)
            missing = not_found_missing(e, stream, "reading the newest published version")
            if missing is not None:
                raise missing from e
            return None
        try:
            return decode(raw.data or b"", WeightsPublished)
        except ProtocolError as e:
            log.warning("rollout: unreadable last WeightsPublished: %s", e)
            return None

    async def fetch_once(self) -> int | None:
        """Receive the newest published version if its transport needs a local copy of it."""
        msg = await self.latest()
        if msg is None or (self.given_up is not None and msg.version <= self.given_up):
            return None
        try:
            transport = self.transports.for_uri(msg.uri)
            got = await transport.receive(msg, self.local_dir, newer_than=self.downloaded)
        except BadWeightsUri as e:
            log.warning("rollout: %s", e)
            return None
        except WeightsTransferError:
            self._failed(msg.version)
            raise
        if got is None:
            return None
        self._failures = (0, 0)
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

    def _failed(self, version: int) -> None:
        """Count a failed attempt at `version`; give it up after `max_attempts` in a row."""
        last, n = self._failures
        n = n + 1 if last == version else 1
        self._failures = (version, n)
        if n < self.max_attempts:
            return
        self.given_up = version
        self._failures = (0, 0)
        log.error(
            "rollout: giving up weights v%d after %d failed attempts; this engine stays on "
            "its current version until a newer one is published",
            version,
            n,
        )
        if self.on_give_up is not None:
            self.on_give_up(version)

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

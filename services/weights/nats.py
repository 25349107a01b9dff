"""The NATS transport: versions as chunks in JetStream, for clusters without shared storage.

`publish` uploads the saved directory (chunks.py: how and why) and
announces `nats://<WEIGHTDATA stream>/<version>` only once every chunk is
stored; `receive`, in the rollout worker beside each engine, downloads a
newer version into the engine's local directory (verified, renamed into
place); `source` is then that local copy, loadable once the engine's
heartbeat reports it; `cleanup` purges the chunks of versions below the
floor from the stream (its max_age is the backstop).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from proto.streams import NATS_WEIGHTS_SCHEME, parse_weights_nats_uri, stream_name, weights_nats_uri
from proto.subjects import Subjects
from proto.weight_version import parse_name
from services.weights.base import BadWeightsUri, LocalCopy, Sent, Transfer, Wiring
from services.weights.chunks import download, purge, upload
from services.weights.layout import version_dir

if TYPE_CHECKING:
    from proto.messages import WeightsPublished

log = logging.getLogger(__name__)


def uri_version(uri: str) -> int:
    """The version a `nats://` weights URI names; BadWeightsUri if it is not one."""
    try:
        return parse_weights_nats_uri(uri)[1]
    except ValueError as e:
        raise BadWeightsUri(str(e)) from e


class NatsTransport:
    kind: ClassVar[str] = "nats"
    scheme: ClassVar[str] = NATS_WEIGHTS_SCHEME

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.run = wiring.run

    async def publish(self, version: int, directory: Path) -> Sent:
        w = self.wiring
        sent = await upload(
            w.js, self.run, version, directory, max_payload=w.max_payload, window=w.upload_window
        )
        return Sent(weights_nats_uri(self.run, version), sent)

    def source(self, uri: str, version: int) -> LocalCopy:
        uri_version(uri)
        return LocalCopy(version)

    async def receive(
        self, msg: WeightsPublished, into: Path, newer_than: int | None
    ) -> Transfer | None:
        version = uri_version(msg.uri)
        if newer_than is not None and version <= newer_than:
            return None
        return await download(
            self.wiring.js,
            self.run,
            version,
            msg.sha256,
            version_dir(into, version),
            idle_timeout_s=self.wiring.idle_timeout_s,
        )

    async def cleanup(self, below: int) -> None:
        from nats.errors import Error as NatsError

        js, subjects = self.wiring.js, Subjects(self.run)
        try:
            info = await js.stream_info(
                stream_name(self.run, "WEIGHTDATA"), subjects_filter=subjects.weightdata_all
            )
            for subject in info.state.subjects or {}:
                v = parse_name(subject.rsplit(".", 1)[-1])
                if v is not None and v < below:
                    await purge(js, self.run, v)
                    log.info("sync: purged NATS chunks of v%d", v)
        except (NatsError, TimeoutError) as e:  # the stream's max_age is the backstop
            log.warning("sync: cannot purge old weight chunks: %r", e)

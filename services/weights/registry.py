"""The weights transports by name: the package's edge, where the implementations meet.

`[trainer] weights_transport` names the trainer's (`open_transport`); readers
open the one an announced URI's scheme names (`Transports`). The protocol is
base.py; each transport imports only it, so nothing here is imported back.
They are imported when first asked for, so importing the package stays light.
"""

from __future__ import annotations

import logging
from typing import Literal
from urllib.parse import urlparse

from services.weights.base import BadWeightsUri, WeightsTransport, Wiring
from services.weights.layout import remove_versions, versions_in

log = logging.getLogger(__name__)

TransportKind = Literal["disk", "nats", "nats-delta", "disk-delta", "distributed"]
"""`[trainer] weights_transport`: the names `_kinds` gives."""


def _kinds() -> dict[str, type[WeightsTransport]]:
    from services.weights.disk import DiskTransport
    from services.weights.diskdelta import DiskDeltaTransport
    from services.weights.distributed import DistTransport
    from services.weights.nats import NatsTransport
    from services.weights.natsdelta import NatsDeltaTransport

    return {
        "disk": DiskTransport,
        "nats": NatsTransport,
        "nats-delta": NatsDeltaTransport,
        "disk-delta": DiskDeltaTransport,
        "distributed": DistTransport,
    }


def open_transport(kind: str, wiring: Wiring) -> WeightsTransport:
    """The trainer's transport, by its `[trainer] weights_transport` name."""
    return _kinds()[kind](wiring)  # type: ignore[call-arg]


class Transports:
    """A reader's transports, opened as announced URIs name them (sync, rollout workers)."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self._open: dict[str, WeightsTransport] = {}

    def for_uri(self, uri: str) -> WeightsTransport:
        """The transport that announced `uri`; BadWeightsUri when none did."""
        scheme = urlparse(uri).scheme
        for kind, cls in _kinds().items():
            if cls.scheme == scheme:
                if kind not in self._open:
                    self._open[kind] = cls(self.wiring)  # type: ignore[call-arg]
                return self._open[kind]
        raise BadWeightsUri(f"unsupported weights uri {uri!r}")

    async def cleanup(self, below: int) -> None:
        """Drop the versions below `below` wherever they are held: the trainer's version
        directories under the root (whatever carried them), and every opened transport."""
        if self.wiring.root is not None:
            run_dir = self.wiring.root / self.wiring.run
            old = [v for v in versions_in(run_dir) if v < below]
            for path in remove_versions(run_dir, old):
                log.info("deleted old weights %s", path)
        for transport in self._open.values():
            await transport.cleanup(below)

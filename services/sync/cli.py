"""`flywheel sync` / `python -m services.sync`."""

from __future__ import annotations

from services.runtime.service_main import service_main
from services.sync.settings import SyncSettings


def _body():  # imported lazily: the app pulls in NATS and aiohttp
    from services.sync.app import body

    return body


def main(argv: list[str] | None = None) -> int:
    return service_main("sync", SyncSettings, _body, argv)

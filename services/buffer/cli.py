"""`flywheel buffer` / `python -m services.buffer`."""

from __future__ import annotations

from services.buffer.settings import BufferSettings
from services.runtime.service_main import service_main


def _body():  # imported lazily: the app pulls in NATS
    from services.buffer.app import body

    return body


def main(argv: list[str] | None = None) -> int:
    return service_main("buffer", BufferSettings, _body, argv)

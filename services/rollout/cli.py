"""`flywheel rollout` / `python -m services.rollout`: a rollout worker."""

from __future__ import annotations

from services.rollout.settings import RolloutSettings
from services.runtime.service_main import service_main


def _body():  # imported lazily: the app pulls in NATS, aiohttp, transformers
    from services.rollout.app import body

    return body


def main(argv: list[str] | None = None) -> int:
    # attach: a worker added by hand to a local `flywheel up` run finds its NATS and model
    return service_main("rollout", RolloutSettings, _body, argv, attach=True)

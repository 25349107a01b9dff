"""What every route handler shares, in a module of its own so that app.py and the
route modules beside it (state_routes.py) both use it without importing each other:
the JSON body, the future a POST answers with, and the check-then-submit step that
answers a retried request with the first one's future.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from services.tinker.core import Entry, TinkerUserError

log = logging.getLogger("flywheel.tinker")


class Accepts(Protocol):
    """What run_if_fresh needs of the service (app.py's Service)."""

    def refuse(self, entry: Entry, error: TinkerUserError) -> None: ...
    async def accept(
        self, request: web.Request, entry: Entry, reads_only: bool = False
    ) -> bool: ...


async def read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise TinkerUserError(f"{request.path}: the body is not JSON ({e})") from e
    if not isinstance(body, dict):
        raise TinkerUserError(f"{request.path}: the body must be a JSON object")
    return body


def future_response(entry: Entry, model_id: str | None = None, **extra: Any) -> web.Response:
    return web.json_response({"request_id": entry.request_id, "model_id": model_id, **extra})


async def run_if_fresh(
    svc: Accepts,
    request: web.Request,
    entry: Entry,
    fresh: bool,
    build: Callable[[], None],
    reads_only: bool = False,
) -> None:
    """Log a new request (the journal, when there is one: journal.py), then run `build`
    (check, then submit); a check's error fails the request's own future. A retry (not
    fresh) is answered by the first one's future. `reads_only`: a forward or a sample,
    which changes no state (a replay answers it from its record)."""
    if not fresh:
        log.info("retried request %s (%s): answered, not run again", entry.request_id, entry.kind)
        return
    if not await svc.accept(request, entry, reads_only):
        return  # answered from the journal's record
    try:
        build()
    except TinkerUserError as e:
        svc.refuse(entry, e)

"""A start on a journal: replay its requests through the HTTP routes' own handlers.

journal.py says what is replayed and why. This module walks the plan: each logged
intake goes to the handler of its route as a `Replayed` request (its path and body,
exactly as the client sent them), with the request log told to give it the id its
client holds, and the replay waits for it to finish before the next one, so the
model thread runs them in log order and every check sees the state it saw live.
Reusing the handlers is the point: a replay cannot take a path the live request did
not, and a bad request fails its check again with the same error, touching nothing.

The server listens only once the replay is done: a client polling meanwhile gets
connection errors, which the SDK retries with backoff.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from aiohttp import web
from multidict import CIMultiDict

from services.tinker.core import Entry, RequestLog, TinkerUserError
from services.tinker.journal import Intake, Journal, JournalCorrupt, Replay, plan

log = logging.getLogger("flywheel.tinker")


class Service(Protocol):
    journal: Journal | None
    replay: Replay | None
    log: RequestLog

    async def wait(self, entry: Entry, timeout: float | None) -> None: ...


Handler = Callable[[web.Request, Any], Awaitable[web.StreamResponse]]


class Replayed:
    """The part of aiohttp's Request the handlers read, for a logged intake."""

    def __init__(self, intake: Intake) -> None:
        self.path = intake.path
        self._body = intake.body
        # The SDK sends forward_backward uncompressed (client config); a compressed body
        # was refused before it could be logged.
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.match_info: dict[str, str] = {}

    async def read(self) -> bytes:
        return self._body

    async def json(self) -> Any:
        return json.loads(self._body)


@dataclass(frozen=True)
class Rebuilt:
    """What a start replayed: `rerun` requests ran again (`steps` of them optim_steps),
    `answered` were answered from their records, `unfinished` ran for the first time;
    in `seconds`."""

    records: int
    rerun: int
    answered: int
    unfinished: int
    steps: int
    seconds: float


async def rebuild(svc: Service, handlers: dict[str, Handler]) -> Rebuilt:
    assert svc.journal is not None
    t0 = time.perf_counter()
    records = await svc.journal.read()
    replay = plan(records)
    counts = {"rerun": 0, "answered": 0, "unfinished": 0, "steps": 0}
    svc.replay = replay
    try:
        for intake in replay.intakes:
            handler = handlers.get(intake.path)
            if handler is None:
                raise JournalCorrupt(
                    f"journal intake {intake.request_id} is for route {intake.path!r}, "
                    "which this server does not serve"
                )
            replay.current = intake
            svc.log.next_id = intake.request_id
            try:
                await handler(cast(web.Request, Replayed(intake)), svc)
            except TinkerUserError as e:
                # Live, a request refused before its future (an unknown model, say) was
                # never logged: this one passed then, so the state was not rebuilt alike.
                log.error("replaying %s (%s): %s", intake.request_id, intake.path, e)
            finally:
                svc.log.next_id, replay.current = None, None
            if svc.log.known(intake.request_id):  # a future: wait for its answer
                await svc.wait(svc.log.get(intake.request_id), None)
            counts[_fate(replay, intake, svc.log.known(intake.request_id))] += 1
            counts["steps"] += intake.path.endswith("/optim_step")
    finally:
        svc.replay = None
    done = Rebuilt(len(records), seconds=time.perf_counter() - t0, **counts)
    log.info(
        "journal %s: %d records replayed in %.2f s: %d requests run again (%d optim_steps), "
        "%d answered from their records, %d unfinished ones run now",
        svc.journal.stream,
        done.records,
        done.seconds,
        done.rerun,
        done.steps,
        done.answered,
        done.unfinished,
    )
    return done


def _fate(replay: Replay, intake: Intake, future: bool) -> str:
    if replay.answered_from_record(intake):
        return "answered"
    if future and intake.request_id not in replay.outcomes:
        return "unfinished"
    return "rerun"  # a future with its outcome, or a session / sampling session made again

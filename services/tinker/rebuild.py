"""A start on a journal: load its newest whole checkpoint, then replay the requests
after it through the HTTP routes' own handlers.

journal.py says what is replayed and why (and when a checkpoint stands in for the
records before it: `plan_start`). This module walks the plan: each logged
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

from services.tinker.checkpoint import CheckpointStore
from services.tinker.core import Entry, RequestLog, TinkerUserError
from services.tinker.journal import Checkpoint, Intake, Journal, JournalCorrupt, Replay, plan_start

log = logging.getLogger("flywheel.tinker")


class Service(Protocol):
    journal: Journal | None
    replay: Replay | None
    log: RequestLog
    checkpoints: CheckpointStore | None

    async def wait(self, entry: Entry, timeout: float | None) -> None: ...
    async def restore(self, cp: Checkpoint) -> None: ...


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
    """What a start replayed: from the checkpoint covering sequence `checkpoint` (0:
    none, the stream's first record), the `records` after it, of which `rerun` requests
    ran again (`steps` of them optim_steps), `answered` were answered from their records,
    `unfinished` ran for the first time; in `seconds`, the checkpoint's load included."""

    checkpoint: int
    records: int
    rerun: int
    answered: int
    unfinished: int
    steps: int
    seconds: float


async def rebuild(svc: Service, handlers: dict[str, Handler]) -> Rebuilt:
    assert svc.journal is not None
    t0 = time.perf_counter()
    first = await svc.journal.first_seq()
    numbered = await svc.journal.read_numbered()
    store = svc.checkpoints
    start = plan_start(numbered, first, lambda cp: _why_not_whole(store, cp))
    for why in start.passed_over:
        log.error("journal %s: passed over %s", svc.journal.stream, why)
    covers = 0
    if start.checkpoint is not None:
        t1 = time.perf_counter()
        await svc.restore(start.checkpoint)
        covers = start.checkpoint.covers
        log.info("journal %s: checkpoint %s loaded in %.2f s", svc.journal.stream,
                 start.checkpoint.directory, time.perf_counter() - t1)  # fmt: skip
    replay = start.replay
    records = [r for seq, r in numbered if seq > covers]
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
    done = Rebuilt(covers, len(records), seconds=time.perf_counter() - t0, **counts)
    log.info(
        "journal %s: from the checkpoint covering sequence %d, %d records replayed in "
        "%.2f s: %d requests run again (%d optim_steps), %d answered from their records, "
        "%d unfinished ones run now",
        svc.journal.stream,
        done.checkpoint,
        done.records,
        done.seconds,
        done.rerun,
        done.steps,
        done.answered,
        done.unfinished,
    )
    return done


def _why_not_whole(store: CheckpointStore | None, cp: Checkpoint) -> str | None:
    if store is None:  # a server without a journal never reads one
        return "no [tinker] checkpoint_dir"
    return store.why_not_whole(cp)


def _fate(replay: Replay, intake: Intake, future: bool) -> str:
    if replay.answered_from_record(intake):
        return "answered"
    if future and intake.request_id not in replay.outcomes:
        return "unfinished"
    return "rerun"  # a future with its outcome, or a session / sampling session made again

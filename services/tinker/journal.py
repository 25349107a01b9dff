"""The durable request log: every accepted request on a JetStream stream, so a restarted
server rebuilds its sessions, adapters and optimizers and answers every future it gave.

Design. The log records *what the clients asked*, not what the model became: each
accepted request that changes or reads state (create_session, create_model,
forward[_backward], optim_step, save/load state, save_weights_for_sampler,
create_sampling_session, sample/compute_logprobs) is appended as an `Intake` record
(its route, its HTTP body exactly as sent, its request id) and acknowledged by
JetStream *before* the client gets its future id; when the request finishes, its
answer is appended as an `Outcome`. The server's in-memory state is a pure function
of the intakes in log order: the model thread runs requests one at a time in the
order they were logged (app.py appends and queues under one lock), every adapter's
initialisation is seeded from its request (its `seed`, else its model id), and on a
CPU with a fixed thread count every forward, backward and AdamW step is bit for bit
what it was. So a restart replays the intakes in order through the same handlers
the HTTP routes use, and:

- a request with a recorded outcome that changed state (create_model, a
  forward_backward with a backward pass, optim_step, loads, sampler snapshots) runs
  again, to rebuild the adapter, its gradients and its AdamW moments, and is
  answered with the recorded outcome (a warning if the rerun differs);
- one that only read state (a forward, a sample) is answered from its record
  without running;
- one logged but without an outcome (in flight when the server died) runs now,
  exactly once, and its outcome is appended;
- a bad request fails its check again with the same user error and touches nothing;
- a retried POST (the SDK's same seq_id) after the restart finds the replayed entry
  in the request log and gets the first one's future: never a second application.

Why replay and not snapshots of the model: the requests are small and few compared
with an adapter and two AdamW moments per step, and a replay from the same requests
is the same computation the client already trusted. What it costs: every
state-changing request since the server's first start is recomputed at each start,
so a restart takes as long as the training so far did (less the samples and
forwards, answered from their records); docs/tinker.md has the measured figure.
Bounding it (a save_state taken as a checkpoint to replay from) is not built.

Records are MessagePack maps on one subject of one stream (`[tinker]
journal_stream`, at `[nats] url`), kept for ever (limits retention, no max age): the
replay needs the log from its first record. A record over NATS's `max_payload` (a
large forward_backward body or output) travels as chunks (proto/chunking.py); a
record whose last chunk never arrived was never acknowledged, so no client holds
its future, and the replay skips it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

    from services.tinker.settings import TinkerSettings

log = logging.getLogger("flywheel.tinker")

VERSION = 1
INTAKE, OUTCOME = "tinker.intake", "tinker.outcome"
PUBLISH_RETRY_S = 30.0  # a JetStream away this long fails the request (503: the SDK retries)


class JournalCorrupt(ValueError):
    """A record on the journal's stream that is not one this server wrote (or of a
    newer version): the replay stops, naming its sequence, rather than guess."""


class JournalUnavailable(ConnectionError):
    """JetStream did not acknowledge an append: the request is not accepted (503)."""


@dataclass(frozen=True)
class Intake:
    """One accepted request, as the client sent it. `request_id` is its future's id,
    or, for the routes that answer at once, the id they created (a session, a
    sampling session)."""

    request_id: str
    path: str  # the route, /api/v1/...
    body: bytes  # the HTTP body, byte for byte (JSON, or the SDK's protobuf)
    reads_only: bool = False  # a forward or a sample: its recorded outcome is enough


@dataclass(frozen=True)
class Outcome:
    """A finished request's answer: `result` (JSON-able or protobuf bytes) or its error."""

    request_id: str
    failed: bool
    result: Any = None
    error: str = ""
    category: str = ""

    def same(self, other: Outcome) -> bool:
        return (self.failed, self.result, self.error, self.category) == (
            other.failed,
            other.result,
            other.error,
            other.category,
        )


Record = Intake | Outcome


def encode(record: Record) -> bytes:
    if isinstance(record, Intake):
        body: dict[str, Any] = {
            "type": INTAKE,
            "v": VERSION,
            "id": record.request_id,
            "path": record.path,
            "body": record.body,
            "reads_only": record.reads_only,
        }
    else:
        body = {
            "type": OUTCOME,
            "v": VERSION,
            "id": record.request_id,
            "failed": record.failed,
            "result": record.result,
            "error": record.error,
            "category": record.category,
        }
    return bytes(msgpack.packb(body, use_bin_type=True))


def decode(data: bytes, seq: int = 0) -> Record:
    """The record in `data`; JournalCorrupt (naming `seq`) if it is not one."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise JournalCorrupt(f"journal record at sequence {seq} is not MessagePack: {e}") from e
    if not isinstance(body, dict) or body.get("type") not in (INTAKE, OUTCOME):
        raise JournalCorrupt(f"journal record at sequence {seq} is not a tinker record")
    if body.get("v") != VERSION:
        raise JournalCorrupt(
            f"journal record at sequence {seq} has version {body.get('v')!r}; "
            f"this server reads {VERSION}"
        )
    try:
        if body["type"] == INTAKE:
            return Intake(
                str(body["id"]), str(body["path"]), bytes(body["body"]), bool(body["reads_only"])
            )
        return Outcome(
            str(body["id"]),
            bool(body["failed"]),
            body["result"],
            str(body["error"]),
            str(body["category"]),
        )
    except (KeyError, TypeError) as e:
        raise JournalCorrupt(f"journal record at sequence {seq} lacks {e}") from e


@dataclass
class Replay:
    """What a start rebuilds from: the intakes in log order (each once) and the
    outcomes by request id. Pure; app.py walks it."""

    intakes: list[Intake] = field(default_factory=list)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    current: Intake | None = None  # the intake being replayed now

    @property
    def unfinished(self) -> list[Intake]:
        """The intakes without an outcome: in flight when the server stopped."""
        return [i for i in self.intakes if i.request_id not in self.outcomes]

    def answered_from_record(self, intake: Intake) -> bool:
        """A read whose outcome is recorded: answered without running it."""
        return intake.reads_only and intake.request_id in self.outcomes


def plan(records: Iterable[Record]) -> Replay:
    """The replay of `records` (in stream order). An intake appended twice (a publish
    retried past JetStream's duplicate window) counts once, at its first place."""
    replay = Replay()
    seen: set[str] = set()
    for record in records:
        if isinstance(record, Intake):
            if record.request_id not in seen:
                seen.add(record.request_id)
                replay.intakes.append(record)
        else:
            replay.outcomes.setdefault(record.request_id, record)
    return replay


def subject_for(stream: str) -> str:
    return f"flywheel.tinker.{stream}"


def record_id(record: Record) -> str:
    """The record's Nats-Msg-Id: a resent append is stored once."""
    suffix = "in" if isinstance(record, Intake) else "out"
    return f"{record.request_id}:{suffix}"


# -- the JetStream adapter ---------------------------------------------------------------


class Journal:
    """Appends records to the stream and reads them back, over one NATS connection."""

    def __init__(self, nc: Client, js: JetStreamContext, stream: str, max_payload: int) -> None:
        self.nc, self.js, self.stream = nc, js, stream
        self.subject = subject_for(stream)
        self.max_payload = max_payload

    @classmethod
    async def open(cls, settings: TinkerSettings) -> Journal:
        """Connect to `[nats] url`, ensure the stream (kept for ever)."""
        from proto.streams import StreamSpec
        from services.runtime.nats_conn import connect, ensure_stream, server_max_payload

        stream = settings.journal_stream
        nc = await connect(settings.nats, f"tinker-{stream}")
        js = nc.jetstream()
        spec = StreamSpec(stream, (subject_for(stream),), max_age_s=0)
        await ensure_stream(js, spec, replicas=settings.nats.replicas)
        return cls(nc, js, stream, server_max_payload(nc, settings.nats.max_payload))

    async def append(self, record: Record) -> None:
        """Store `record` (chunked if it must be); JournalUnavailable if JetStream does
        not acknowledge it within PUBLISH_RETRY_S."""
        from proto.chunking import split

        mid = record_id(record)
        parts = split(encode(record), mid, self.max_payload)
        for i, part in enumerate(parts):
            await self._publish(part, mid if len(parts) == 1 else f"{mid}:c{i}")

    async def _publish(self, data: bytes, mid: str) -> None:
        from services.runtime.transient import transient_errors

        transient = transient_errors()
        deadline, delay = time.monotonic() + PUBLISH_RETRY_S, 0.05
        while True:
            try:
                await self.js.publish(self.subject, data, headers={"Nats-Msg-Id": mid})
                return
            except transient as e:
                if time.monotonic() + delay > deadline:
                    raise JournalUnavailable(
                        f"the tinker journal {self.stream!r} did not acknowledge {mid}: {e!r}"
                    ) from e
                log.warning("journal append %s failed (%r); retrying in %.2fs", mid, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)

    async def read(self) -> list[Record]:
        """Every record on the stream now, in order (chunks joined)."""
        from services.runtime.recording import recorded

        return [decode(whole, seq) async for seq, whole in recorded(self.js, self.stream)]

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

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

Why replay and not snapshots of the model at every step: the requests are small and
few compared with an adapter and two AdamW moments per step, and a replay from the same
requests is the same computation the client already trusted. What it costs: every
state-changing request since the point the replay starts from is recomputed at each
start, so without a bound a restart takes as long as the training so far did.

The bound: a replay checkpoint (checkpoint.py writes and reads it). Every `[tinker]
journal_checkpoint_every` optim_steps the server stops taking requests for a moment
(it holds the intake lock), waits until every accepted one is answered, copies the
whole state the replay would rebuild (every model's adapter, gradients, AdamW state and
step count, the sessions, the samplers and their snapshots, the request log) and notes
the last sequence on the stream, which that state covers; then it takes requests
again while it writes the copy to a directory (temporary directory + rename) and
appends a `Checkpoint` record naming the directory and the sequence it covers. A start
loads the newest checkpoint whose directory is whole and replays only the intakes
after the sequence it covers (`plan_start`, pure). Once checkpoint k is on the stream,
the records up to the sequence checkpoint k-1 covers are purged (JetStream purge up to
a sequence), and older directories removed: the stream holds about two checkpoint
intervals, and a start whose newest directory is missing or half-written falls back to
the one before (or to the full log when nothing was ever purged); when the records an
older checkpoint needs are gone too, the start stops with `JournalIncomplete`, naming
what is missing, rather than start empty. A request answered before checkpoint k-1 has
its answer dropped at checkpoint k (its future then fails with an "expired" user error;
a retry of it is still never run again): answers are kept for one checkpoint interval.

Records are MessagePack maps on one subject of one stream (`[tinker]
journal_stream`, at `[nats] url`), limits retention with no max age: only the
checkpoints' purges remove records (without checkpoints the stream is kept for ever, as
the replay needs it from its first record). A record over NATS's `max_payload` (a
large forward_backward body or output) travels as chunks (proto/chunking.py); a
record whose last chunk never arrived was never acknowledged, so no client holds
its future, and the replay skips it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

    from services.tinker.settings import TinkerSettings

log = logging.getLogger("flywheel.tinker")

VERSION = 1
INTAKE, OUTCOME, CHECKPOINT = "tinker.intake", "tinker.outcome", "tinker.checkpoint"
PUBLISH_RETRY_S = 30.0  # a JetStream away this long fails the request (503: the SDK retries)


class JournalCorrupt(ValueError):
    """A record on the journal's stream that is not one this server wrote (or of a
    newer version): the replay stops, naming its sequence, rather than guess."""


class JournalIncomplete(JournalCorrupt):
    """The stream lacks records a start needs (purged after a checkpoint) and no
    checkpoint directory that would stand in for them is whole: the start stops."""


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


@dataclass(frozen=True)
class Checkpoint:
    """A replay checkpoint (checkpoint.py): the directory (under `[tinker] checkpoint_dir`
    /<stream>/) holding the state after every record up to sequence `covers`."""

    directory: str
    covers: int


Record = Intake | Outcome | Checkpoint


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
    elif isinstance(record, Checkpoint):
        body = {
            "type": CHECKPOINT,
            "v": VERSION,
            "directory": record.directory,
            "covers": record.covers,
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
    if not isinstance(body, dict) or body.get("type") not in (INTAKE, OUTCOME, CHECKPOINT):
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
        if body["type"] == CHECKPOINT:
            return Checkpoint(str(body["directory"]), int(body["covers"]))
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
    retried past JetStream's duplicate window) counts once, at its first place.
    Checkpoint records are not requests: plan_start chooses among them."""
    replay = Replay()
    seen: set[str] = set()
    for record in records:
        if isinstance(record, Checkpoint):
            continue
        if isinstance(record, Intake):
            if record.request_id not in seen:
                seen.add(record.request_id)
                replay.intakes.append(record)
        else:
            replay.outcomes.setdefault(record.request_id, record)
    return replay


@dataclass(frozen=True)
class Start:
    """Where a start begins: the checkpoint to load (None: the stream's first record)
    and the replay of the records after it; `passed_over`, the newer checkpoints whose
    directories were not whole, each with why."""

    checkpoint: Checkpoint | None
    replay: Replay
    passed_over: list[str]


def plan_start(
    numbered: Sequence[tuple[int, Record]],
    first_seq: int,
    why_not_whole: Callable[[Checkpoint], str | None],
) -> Start:
    """The newest checkpoint that `why_not_whole` finds whole (None) and whose later
    records the stream still holds (it starts at `first_seq`), and the replay of the
    records after the sequence it covers; with none, the whole stream when nothing of
    it was purged (`first_seq` 1), else JournalIncomplete naming what is missing."""
    passed_over: list[str] = []
    checkpoints = [r for _, r in numbered if isinstance(r, Checkpoint)]
    for cp in reversed(checkpoints):
        why = why_not_whole(cp)
        if why is None and cp.covers + 1 < first_seq:
            why = f"the stream no longer holds the records after sequence {cp.covers}"
        if why is None:
            after = [r for seq, r in numbered if seq > cp.covers]
            return Start(cp, plan(after), passed_over)
        passed_over.append(f"checkpoint {cp.directory!r} (to sequence {cp.covers}): {why}")
    if first_seq > 1:
        missing = "; ".join(passed_over) or "no checkpoint record is on the stream"
        raise JournalIncomplete(
            f"the journal's records before sequence {first_seq} were purged and no checkpoint "
            f"stands in for them: {missing}"
        )
    return Start(None, plan(r for _, r in numbered), passed_over)


def subject_for(stream: str) -> str:
    return f"flywheel.tinker.{stream}"


def record_id(record: Record) -> str:
    """The record's Nats-Msg-Id: a resent append is stored once."""
    if isinstance(record, Checkpoint):
        return f"checkpoint:{record.covers}"
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

    async def append(self, record: Record) -> int:
        """Store `record` (chunked if it must be); its (last part's) sequence.
        JournalUnavailable if JetStream does not acknowledge it within PUBLISH_RETRY_S."""
        from proto.chunking import split

        mid = record_id(record)
        parts = split(encode(record), mid, self.max_payload)
        seq = 0
        for i, part in enumerate(parts):
            seq = await self._publish(part, mid if len(parts) == 1 else f"{mid}:c{i}")
        return seq

    async def _publish(self, data: bytes, mid: str) -> int:
        from services.runtime.transient import transient_errors

        transient = transient_errors()
        deadline, delay = time.monotonic() + PUBLISH_RETRY_S, 0.05
        while True:
            try:
                ack = await self.js.publish(self.subject, data, headers={"Nats-Msg-Id": mid})
                return int(ack.seq)
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
        return [record for _, record in await self.read_numbered()]

    async def read_numbered(self) -> list[tuple[int, Record]]:
        """(sequence, record) of every record the stream holds now, from its first
        (a checkpoint's purge moves it), in order; a chunked record at its last part's."""
        from services.runtime.recording import recorded

        first = await self.first_seq()
        return [
            (seq, decode(whole, seq))
            async for seq, whole in recorded(self.js, self.stream, start_seq=first)
        ]

    async def first_seq(self) -> int:
        from services.runtime.recording import extent

        return (await extent(self.js, self.stream, "reading the tinker journal")).first

    async def last_seq(self) -> int:
        from services.runtime.recording import extent

        return (await extent(self.js, self.stream, "checkpointing the tinker journal")).last

    async def purge_before(self, seq: int) -> None:
        """Remove every record before sequence `seq` (a checkpoint covers them)."""
        await self.js.purge_stream(self.stream, seq=seq)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

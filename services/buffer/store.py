"""The buffer's KV bucket as a journal of small writes (the codec is services.buffer.state).

Writes are queued in the order the state changed and stored in that order by
`flush`, which the buffer awaits before it acks the message that changed the
state (and before it publishes a batch). A write that fails stays queued, with
everything after it, and goes first at the next flush: the stored records
are always a prefix of the decisions made, which is what `recover` relies on
(an accepted record before its batch key, a batch key before its publish).

Forgetting: the records and batch keys (`r.>`) of settled groups no longer
remembered are removed by one stream purge below the lowest revision still
needed, so a batch key and the records written before it go together.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proto.streams import kv_bucket
from services.buffer.core import BufferState
from services.buffer.curriculum import PromptKey, PromptStats
from services.buffer.state import (
    BATCH_PREFIX,
    GROUP_PREFIX,
    HEAD_KEY,
    RECORDS,
    BufferStateError,
    Recovered,
    batch_key,
    dump_batch,
    dump_prompt,
    gid_of,
    group_key,
    new_form,
    prompt_key,
    recover,
)
from services.runtime.missing import no_answer_errors, not_found_missing, raise_if_missing
from services.runtime.nats_conn import ensure_kv

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

    from services.runtime.lifecycle import ServiceContext

log = logging.getLogger(__name__)


async def open_kv(ctx: ServiceContext, run: str) -> KeyValue:
    """The run's buffer bucket (created, or scaled to `[nats] replicas`)."""
    replicas = ctx.settings.nats.replicas
    return await ensure_kv(ctx.js, kv_bucket(run, "buffer"), replicas=replicas, history=1)


READ_ATTEMPTS = 5


async def read_entries(kv: KeyValue) -> dict[str, tuple[bytes, int]]:
    """Every live key of the bucket: key -> (value, revision). One ordered consumer.

    A read that ends before any entry while the bucket's stream holds messages is
    not believed: on a cluster just after members restarted, a watcher has ended
    at once (its consumer reported nothing pending) over 109 stored values. Taken
    for an empty bucket, that would make a restarting buffer start the run over.
    So it is read again, and after `READ_ATTEMPTS` it is an error, never "fresh".
    """
    for attempt in range(READ_ATTEMPTS):
        entries, seen = await _read_once(kv)
        if seen:
            return entries
        stored = (await kv.status()).values
        if stored == 0:
            return entries  # truly empty: a new run
        log.warning("buffer: a read of the state found nothing over %d stored messages; "
                    "reading again", stored)  # fmt: skip
        await asyncio.sleep(0.1 * 2**attempt)
    raise BufferStateError(
        f"the buffer's bucket holds {stored} messages but {READ_ATTEMPTS} reads found none"
    )


async def _read_once(kv: KeyValue) -> tuple[dict[str, tuple[bytes, int]], int]:
    """The live keys, and how many entries (delete markers too) the watcher gave."""
    watcher = await kv.watchall()
    entries: dict[str, tuple[bytes, int]] = {}
    seen = 0
    try:
        async for entry in watcher:
            if entry is None:  # the end of what is stored
                break
            seen += 1
            if entry.operation is None:  # a value, not a delete or purge marker
                entries[entry.key] = (entry.value or b"", entry.revision or 0)
    finally:
        await watcher.stop()
    return entries, seen


async def read_state(kv: KeyValue) -> Recovered:
    """The stored state, read only (`flywheel status`, the chaos suite's accounting)."""
    return recover({k: v for k, (v, _) in (await read_entries(kv)).items()})


async def read_status(js: JetStreamContext, run: str) -> dict[str, Any] | None:
    """The buffer's persisted state as `flywheel status` shows it (services/stack/inspect.py,
    which services/cli.py hands this), None before the buffer wrote one."""
    from nats.js.errors import NotFoundError

    try:
        rec = await read_state(await js.key_value(kv_bucket(run, "buffer")))
    except NotFoundError:  # no bucket yet
        return None
    if rec.fresh:
        return None
    state, pending = rec.state, rec.pending
    return {
        "next_step": state.next_step,
        "dispatched": state.dispatched,
        "in_flight": state.in_flight,
        "pending_groups": len(pending),
        "epoch": state.cursor.epoch,
    }


@dataclass(frozen=True)
class _Put:
    key: str
    value: bytes


@dataclass(frozen=True)
class _Purge:
    below: int  # remove every record and batch key stored before this revision


class StateStore:
    """The journal of one buffer's state writes (module docstring)."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, bucket: str) -> None:
        self.js, self.kv = js, kv
        self.stream, self.prefix = f"KV_{bucket}", f"$KV.{bucket}."
        self._queue: deque[_Put | _Purge] = deque()
        self.revs: dict[str, int] = {}  # group id -> revision of its record
        self.batch_revs: dict[int, int] = {}  # step -> revision of its batch key
        self.purged_below = 0  # revision
        self._forgot = 0  # step: forget() ran up to here

    @property
    def dirty(self) -> bool:
        return bool(self._queue)

    def group(self, gid: str, record: bytes) -> None:
        """A group's decision (state.dump_accepted / dump_settled)."""
        self._queue.append(_Put(group_key(gid), record))

    def prompt(self, key: PromptKey, stats: PromptStats) -> None:
        """A prompt's curriculum record (state.dump_prompt), rewritten in place."""
        self._queue.append(_Put(prompt_key(key), dump_prompt(stats)))

    def batch(self, step: int, created_at: float, seqs: list[int]) -> None:
        self._queue.append(_Put(batch_key(step), dump_batch(created_at, seqs)))

    def head(self, head: bytes) -> None:
        self._queue.append(_Put(HEAD_KEY, head))

    def forget(
        self, state: BufferState, pending: Iterable[str], from_step: int, head: bytes
    ) -> None:
        """Purge what the buffer no longer remembers: it keeps `state.settled`, the
        `pending` group ids and the batches from `from_step` on. The head goes first:
        counters are the largest any stored write carried."""
        if from_step <= self._forgot:
            return  # nothing new forgotten (this runs per group; the scan below per step)
        self._forgot = from_step
        keep = [self.revs[g] for g in (*state.settled, *pending) if g in self.revs]
        keep += [r for s, r in self.batch_revs.items() if s >= from_step]
        below = min(keep, default=0)
        if below <= self.purged_below:
            return
        self.revs = {g: r for g, r in self.revs.items() if r >= below}
        self.batch_revs = {s: r for s, r in self.batch_revs.items() if r >= below}
        self._queue += [_Put(HEAD_KEY, head), _Purge(below)]
        self.purged_below = below

    async def flush(self) -> None:
        """Store the queued writes in order; one that fails is left first in the queue.

        A bucket that is gone stops the buffer (JetStreamMissing): its writes could
        never be stored again, and the old code retried them every round, forever.
        """
        from nats.js.errors import NotFoundError

        while self._queue:
            op = self._queue[0]
            try:
                await self._store(op)
            except no_answer_errors():
                await raise_if_missing(self.js, self.stream, "writing the buffer's state")
                raise
            except NotFoundError as e:
                missing = not_found_missing(e, self.stream, "purging the buffer's state")
                if missing is None:
                    raise
                raise missing from e
            self._queue.popleft()

    async def _store(self, op: _Put | _Purge) -> None:
        if isinstance(op, _Purge):
            records = f"{self.prefix}{RECORDS}.>"
            await self.js.purge_stream(self.stream, subject=records, seq=op.below)
        else:
            self._remember(op.key, await self.kv.put(op.key, op.value))

    def _remember(self, key: str, rev: int) -> None:
        """The revision of a record or batch key (what `forget` purges below)."""
        if key.startswith(GROUP_PREFIX):
            self.revs[gid_of(key)] = rev
        elif key.startswith(BATCH_PREFIX):
            self.batch_revs[int(key.removeprefix(BATCH_PREFIX))] = rev

    async def load(self) -> Recovered:
        """The stored state; an old-form state is written in the new form, then removed."""
        entries = await read_entries(self.kv)
        rec = recover({k: v for k, (v, _) in entries.items()})
        for key, (_, rev) in entries.items():
            self._remember(key, rev)
        if rec.migrate:
            self._queue += [_Put(k, v) for k, v in new_form(rec)]
            await self.flush()
        for key in rec.old_keys:  # a stream purge leaves no delete marker behind
            await self.js.purge_stream(self.stream, subject=f"{self.prefix}{key}")
        return rec


async def open_store(ctx: ServiceContext, run: str) -> StateStore:
    return StateStore(ctx.js, await open_kv(ctx, run), kv_bucket(run, "buffer"))

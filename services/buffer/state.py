"""The buffer's persisted state: its KV bucket, and the codec of what it keeps there.

Key `state`: the dataset cursor, the counters, the next step, the ready
version, the settled group ids, and the pending groups as SAMPLES stream
sequences (the groups themselves are re-read from the stream on restart).
Key `outbox`: the batches decided but maybe not yet published (app.py says
why they go through it). Both are MessagePack maps and lists of plain
integers and strings, validated field by field on read: a state that
cannot be read stops the buffer (`BufferStateError`) rather than starting
it over. `flywheel status` reads the same codec (services/stack/inspect.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack

from proto.streams import kv_bucket
from services.buffer.core import BufferState, Cursor
from services.common.errors import FlywheelError
from services.common.nats_conn import ensure_kv

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

    from services.common.lifecycle import ServiceContext

STATE_KEY = "state"
OUTBOX_KEY = "outbox"
STATE_FIELDS = "cursor dispatched answered next_step ready_version settled pending".split()


async def open_kv(ctx: ServiceContext, run: str) -> KeyValue:
    """The run's buffer bucket (created, or scaled to `[nats] replicas`)."""
    replicas = ctx.settings.nats.replicas
    return await ensure_kv(ctx.js, kv_bucket(run, "buffer"), replicas=replicas, history=1)


def dump_state(state: BufferState, pending: list[tuple[str, int]]) -> bytes:
    return msgpack.packb(
        {
            "cursor": [state.cursor.epoch, state.cursor.offset],
            "dispatched": state.dispatched,
            "answered": state.answered,
            "next_step": state.next_step,
            "ready_version": state.ready_version,
            "settled": {k: list(v) for k, v in state.settled.items()},
            "pending": [list(p) for p in pending],
        }
    )


class BufferStateError(FlywheelError, ValueError):
    """The persisted buffer state cannot be read (corrupt, or written by an incompatible version).

    The buffer refuses to start rather than start over: a fresh state would
    re-dispatch the whole dataset and re-number steps the trainer has done.
    """


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise BufferStateError(f"{what} is not MessagePack: {e}") from e


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BufferStateError(f"buffer state: {what} must be an integer >= 0, got {value!r}")
    return value


def _pair(value: object, what: str) -> list[object]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise BufferStateError(f"buffer state: {what} must be a pair, got {value!r}")
    return list(value)


def _str(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BufferStateError(f"buffer state: {what} must be a non-empty string, got {value!r}")
    return value


def load_state(data: bytes) -> tuple[BufferState, list[tuple[str, int]]]:
    """Parse what `dump_state` wrote; BufferStateError names what is wrong."""
    d = _unpack(data, "buffer state")
    if not isinstance(d, dict):
        raise BufferStateError(f"buffer state must be a map, got {type(d).__name__}")
    missing = set(STATE_FIELDS) - set(d)
    if missing:
        raise BufferStateError(f"buffer state lacks {sorted(missing)}")
    epoch, offset = _pair(d["cursor"], "cursor")
    if not isinstance(d["settled"], dict):
        raise BufferStateError("buffer state: settled must be a map")
    settled: dict[str, tuple[int, str]] = {}
    for gid, v in d["settled"].items():
        step, verdict = _pair(v, f"settled[{gid!r}]")
        settled[_str(gid, "a settled group id")] = (
            _int(step, "a settled step"),
            _str(verdict, "a settled verdict"),
        )
    if not isinstance(d["pending"], list | tuple):
        raise BufferStateError("buffer state: pending must be a list")
    pending = []
    for p in d["pending"]:
        gid, seq = _pair(p, "a pending entry")
        pending.append((_str(gid, "a pending group id"), _int(seq, "a pending sequence")))
    state = BufferState(
        cursor=Cursor(_int(epoch, "cursor epoch"), _int(offset, "cursor offset")),
        dispatched=_int(d["dispatched"], "dispatched"),
        answered=_int(d["answered"], "answered"),
        next_step=_int(d["next_step"], "next_step"),
        ready_version=_int(d["ready_version"], "ready_version"),
        settled=settled,
    )
    if state.answered > state.dispatched:
        raise BufferStateError(
            f"buffer state: answered {state.answered} > dispatched {state.dispatched}"
        )
    return state, pending


def dump_outbox(batches: list[tuple[int, float, list[int]]]) -> bytes:
    """Batches decided but maybe not yet published: (step, created_at, SAMPLES seqs)."""
    return msgpack.packb([[step, at, list(seqs)] for step, at, seqs in batches])


def load_outbox(data: bytes) -> list[tuple[int, float, list[int]]]:
    """Parse what `dump_outbox` wrote (empty bytes: an empty outbox)."""
    if not data:
        return []
    doc = _unpack(data, "buffer outbox")
    if not isinstance(doc, list):
        raise BufferStateError(f"buffer outbox must be a list, got {type(doc).__name__}")
    out = []
    for entry in doc:
        if not isinstance(entry, list) or len(entry) != 3:
            raise BufferStateError(f"buffer outbox entry must be a triple, got {entry!r}")
        step, at, seqs = entry
        if not isinstance(at, float | int) or not isinstance(seqs, list):
            raise BufferStateError(f"buffer outbox entry {entry!r} has the wrong types")
        out.append((_int(step, "outbox step"), float(at), [_int(s, "outbox seq") for s in seqs]))
    return out

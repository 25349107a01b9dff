"""The buffer's persisted state: the codec of what it keeps in its KV bucket (pure: no NATS).

Every write is O(1) in the number of groups per step G (bench/buffer_state.py):

- `r.g.<group id, base64url>` per decided group: its answered count `n` after
  the decision, and either its SAMPLES sequence (accepted: pending until a
  batch lists that sequence) or its settled step and verdict (dropped,
  dead-lettered, or migrated). One small put per group event.
- `r.b.<step>` per batch: created_at and its groups' SAMPLES sequences,
  written (once) before the batch is published; the outbox of the old form.
- `head`: cursor, counters, next step, ready version, and `published` (the
  first step not known to be published), written per dispatch, ready version
  and batch.
- `c.<task name, base64url>.<row>` per prompt seen: its curriculum record
  (groups, pass rate, the step its rest ends; services/buffer/curriculum.py),
  written with the decision of each of its groups. Never purged: the pass
  rates outlive any step (one key per prompt, rewritten in place).

The state is the merge of the three (`recover`): answered and next_step are
the largest any record says (every write carries the count at that time),
settled = dropped records + accepted records whose sequence a batch lists,
pending = the other accepted records in decision order. Old records are
purged by stream sequence (the KV stream's purge, `seq` under `r.>`): one
operation removes a batch key and every group record written before it, so
an accepted group's record never outlives its batch key (it would read as
pending: trained twice). services/buffer/store.py is the KV adapter.

The old form (one key `state` holding everything, rewritten per group, and
an `outbox` key) is still read: `recover` merges it, the store writes the
new form and removes it. Everything is MessagePack of plain integers and
strings, validated field by field: a state that cannot be read stops the
buffer (`BufferStateError`, `BufferRecordError` naming the key) rather than
starting it over. `flywheel status` reads the same codec.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from services.buffer.core import BufferState, Cursor, Verdict
from services.buffer.curriculum import PromptKey, PromptStats
from services.runtime.errors import FlywheelError

STATE_KEY = "state"  # the old form (read, migrated, removed)
OUTBOX_KEY = "outbox"  # the old form's outbox
STATE_FIELDS = "cursor dispatched answered next_step ready_version settled pending".split()
HEAD_KEY = "head"
RECORDS = "r"  # the prefix of group records and batch keys, purged together by sequence
GROUP_PREFIX, BATCH_PREFIX = f"{RECORDS}.g.", f"{RECORDS}.b."
HEAD_FIELDS = "cursor dispatched answered next_step ready_version published".split()
PROMPT_PREFIX = "c."  # a prompt's curriculum record: never purged (not under `r.`)


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


class BufferRecordError(BufferStateError):
    """One key of the buffer's bucket cannot be read: `key` names it, `reason` says why."""

    def __init__(self, key: str, reason: str) -> None:
        self.key, self.reason = key, reason
        super().__init__(f"buffer state key {key!r}: {reason}")


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


def _map(data: bytes, what: str, fields: list[str]) -> dict[str, Any]:
    d = _unpack(data, what)
    if not isinstance(d, dict):
        raise BufferStateError(f"{what} must be a map, got {type(d).__name__}")
    missing = set(fields) - set(d)
    if missing:
        raise BufferStateError(f"{what} lacks {sorted(missing)}")
    return d


def _counters(d: dict[str, Any]) -> BufferState:
    """The cursor and counters of a state or head map (checked: answered <= dispatched)."""
    epoch, offset = _pair(d["cursor"], "cursor")
    state = BufferState(
        cursor=Cursor(_int(epoch, "cursor epoch"), _int(offset, "cursor offset")),
        dispatched=_int(d["dispatched"], "dispatched"),
        answered=_int(d["answered"], "answered"),
        next_step=_int(d["next_step"], "next_step"),
        ready_version=_int(d["ready_version"], "ready_version"),
    )
    if state.answered > state.dispatched:
        raise BufferStateError(
            f"buffer state: answered {state.answered} > dispatched {state.dispatched}"
        )
    return state


def load_state(data: bytes) -> tuple[BufferState, list[tuple[str, int]]]:
    """Parse what `dump_state` wrote (the old form); BufferStateError names what is wrong."""
    d = _map(data, "buffer state", STATE_FIELDS)
    state = _counters(d)
    if not isinstance(d["settled"], dict):
        raise BufferStateError("buffer state: settled must be a map")
    for gid, v in d["settled"].items():
        step, verdict = _pair(v, f"settled[{gid!r}]")
        state.settled[_str(gid, "a settled group id")] = (
            _int(step, "a settled step"),
            _str(verdict, "a settled verdict"),
        )
    if not isinstance(d["pending"], list | tuple):
        raise BufferStateError("buffer state: pending must be a list")
    pending = []
    for p in d["pending"]:
        gid, seq = _pair(p, "a pending entry")
        pending.append((_str(gid, "a pending group id"), _int(seq, "a pending sequence")))
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


# ── the new form ──────────────────────────────────────────────────────────────
def group_key(gid: str) -> str:
    """A group's record key (KV keys allow `[-/_=.a-zA-Z0-9]`: the id is base64url)."""
    return GROUP_PREFIX + base64.urlsafe_b64encode(gid.encode()).decode()


def batch_key(step: int) -> str:
    return f"{BATCH_PREFIX}{step}"


def gid_of(key: str) -> str:
    """The group id of a record key (BufferRecordError if it is not one)."""
    if not key.startswith(GROUP_PREFIX):
        raise BufferRecordError(key, "not a group record key")
    try:
        gid = base64.urlsafe_b64decode(key.removeprefix(GROUP_PREFIX).encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as e:
        raise BufferRecordError(key, f"not a base64url group id: {e}") from e
    if not gid:
        raise BufferRecordError(key, "an empty group id")
    return gid


def dump_head(state: BufferState, published: int) -> bytes:
    """Cursor, counters, next step, ready version; `published`: the first step whose batch
    is not known to be published (the batch keys from there on are re-published)."""
    return msgpack.packb(
        {
            "cursor": [state.cursor.epoch, state.cursor.offset],
            "dispatched": state.dispatched,
            "answered": state.answered,
            "next_step": state.next_step,
            "ready_version": state.ready_version,
            "published": published,
        }
    )


def load_head(data: bytes) -> tuple[BufferState, int]:
    d = _map(data, "buffer head", HEAD_FIELDS)
    state = _counters(d)
    published = _int(d["published"], "published")
    if published > state.next_step:
        raise BufferStateError(f"buffer head: published {published} > next_step")
    return state, published


def dump_accepted(n: int, seq: int) -> bytes:
    """An accepted group: `n` = answered after it, `seq` = its SAMPLES stream sequence."""
    return msgpack.packb({"n": n, "seq": seq})


def dump_settled(n: int, step: int, verdict: str) -> bytes:
    """A group settled without a batch key (dropped, dead-lettered; or migrated)."""
    return msgpack.packb({"n": n, "step": step, "v": verdict})


@dataclass(frozen=True)
class GroupRecord:
    gid: str
    n: int  # answered after its decision
    seq: int | None = None  # accepted: its SAMPLES sequence
    step: int = 0  # settled (seq None): the step and the verdict
    verdict: str = ""


def load_record(key: str, data: bytes) -> GroupRecord:
    """Parse what `dump_accepted` / `dump_settled` wrote under `key`."""
    gid = gid_of(key)
    try:
        d = _map(data, "group record", ["n"])
        n = _int(d["n"], "n")
        if "seq" in d:
            return GroupRecord(gid, n, seq=_int(d["seq"], "seq"))
        if "step" not in d or "v" not in d:
            raise BufferStateError("a group record needs seq, or step and v")
        return GroupRecord(gid, n, step=_int(d["step"], "step"), verdict=_str(d["v"], "v"))
    except BufferStateError as e:
        raise BufferRecordError(key, str(e)) from e


def dump_batch(created_at: float, seqs: list[int]) -> bytes:
    """A batch decided (stored before it is published): created_at, its groups' sequences."""
    return msgpack.packb({"at": created_at, "seqs": list(seqs)})


def load_batch(key: str, data: bytes) -> tuple[int, float, list[int]]:
    """`(step, created_at, seqs)` of the batch key `key`."""
    step = key.removeprefix(BATCH_PREFIX)
    if not key.startswith(BATCH_PREFIX) or not step.isdigit():
        raise BufferRecordError(key, "not a batch key")
    try:
        d = _map(data, "batch", ["at", "seqs"])
        if not isinstance(d["at"], float | int) or not isinstance(d["seqs"], list):
            raise BufferStateError("at must be a number and seqs a list")
        return int(step), float(d["at"]), [_int(q, "a batch seq") for q in d["seqs"]]
    except BufferStateError as e:
        raise BufferRecordError(key, str(e)) from e


def prompt_key(key: PromptKey) -> str:
    """A prompt's record key: `c.<task name, base64url>.<row>`."""
    name, row = key
    return f"{PROMPT_PREFIX}{base64.urlsafe_b64encode(name.encode()).decode()}.{row}"


def dump_prompt(stats: PromptStats) -> bytes:
    """A prompt's curriculum record: groups seen, pass rate, the step its rest ends."""
    return msgpack.packb({"g": stats.groups, "p": stats.pass_rate, "r": stats.rest_until})


def load_prompt(key: str, data: bytes) -> tuple[PromptKey, PromptStats]:
    """Parse what `dump_prompt` wrote under `key` (BufferRecordError names the key)."""
    name64, _, row = key.removeprefix(PROMPT_PREFIX).rpartition(".")
    try:
        if not key.startswith(PROMPT_PREFIX) or not row.isdigit():
            raise BufferStateError("not a prompt record key")
        try:
            name = base64.urlsafe_b64decode(name64.encode()).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError) as e:
            raise BufferStateError(f"not a base64url task name: {e}") from e
        d = _map(data, "prompt record", ["g", "p", "r"])
        rate = d["p"]
        if isinstance(rate, bool) or not isinstance(rate, float | int) or not 0 <= rate <= 1:
            raise BufferStateError(f"pass rate must be a number in [0, 1], got {rate!r}")
        stats = PromptStats(_int(d["g"], "g"), float(rate), _int(d["r"], "r"))
        return (_str(name, "task name"), int(row)), stats
    except BufferStateError as e:
        raise BufferRecordError(key, str(e)) from e


@dataclass
class Recovered:
    """The buffer's state merged from its bucket (`recover`)."""

    state: BufferState = field(default_factory=BufferState)
    pending: list[tuple[str, int]] = field(default_factory=list)  # (group id, SAMPLES seq)
    unpublished: list[tuple[int, float, list[int]]] = field(default_factory=list)
    fresh: bool = True  # nothing stored: a new run
    prompts: dict[PromptKey, PromptStats] = field(default_factory=dict)  # the curriculum
    old_keys: list[str] = field(default_factory=list)  # the old form's keys, still there
    migrate: bool = False  # read from the old form: the new form is to be written

    @property
    def published(self) -> int:
        return self.unpublished[0][0] if self.unpublished else self.state.next_step


def recover(entries: Mapping[str, bytes]) -> Recovered:
    """Merge a bucket's keys (key -> value) into the state (module docstring: how)."""
    rec = Recovered(old_keys=[k for k in (STATE_KEY, OUTBOX_KEY) if k in entries])
    published = 0
    batches: dict[int, tuple[float, list[int]]] = {}
    if HEAD_KEY in entries:
        rec.state, published = _decoded(HEAD_KEY, load_head, entries[HEAD_KEY])
    elif STATE_KEY in entries:  # the old form (a new-form head means it was migrated)
        rec.state, rec.pending = _decoded(STATE_KEY, load_state, entries[STATE_KEY])
        outbox = _decoded(OUTBOX_KEY, load_outbox, entries.get(OUTBOX_KEY, b""))
        batches = {s: (at, q) for s, at, q in outbox if s < rec.state.next_step}
        published, rec.migrate = min(batches, default=rec.state.next_step), True
    records = []
    for key, data in entries.items():
        if key.startswith(BATCH_PREFIX):
            step, at, seqs = load_batch(key, data)
            batches[step] = (at, seqs)
        elif key.startswith(GROUP_PREFIX):
            records.append(load_record(key, data))
        elif key.startswith(PROMPT_PREFIX):
            pkey, stats = load_prompt(key, data)
            rec.prompts[pkey] = stats
    rec.fresh = not entries
    _merge(rec, batches, records)
    rec.unpublished = sorted((s, at, q) for s, (at, q) in batches.items() if s >= published)
    return rec


def _decoded(key: str, load: Any, data: bytes) -> Any:
    try:
        return load(data)
    except BufferRecordError:
        raise
    except BufferStateError as e:
        raise BufferRecordError(key, str(e)) from e


def _merge(
    rec: Recovered, batches: dict[int, tuple[float, list[int]]], records: list[GroupRecord]
) -> None:
    """Counters are the largest any write carried; an accepted record is settled if a
    batch lists its sequence, else pending (in decision order)."""
    st = rec.state
    batched = {seq: step for step, (_, seqs) in batches.items() for seq in seqs}
    st.next_step = max([st.next_step, *(s + 1 for s in batches)])
    waiting: list[tuple[int, str, int]] = []  # (n, group id, seq)
    for r in records:
        st.answered = max(st.answered, r.n)
        if r.seq is None:
            st.settled[r.gid] = (r.step, r.verdict)
        elif r.seq in batched:
            st.settled[r.gid] = (batched[r.seq], Verdict.ACCEPTED)
        else:
            waiting.append((r.n, r.gid, r.seq))
    have = {gid for gid, _ in rec.pending} | set(st.settled)
    rec.pending += [(gid, seq) for _, gid, seq in sorted(waiting) if gid not in have]


def new_form(rec: Recovered) -> list[tuple[str, bytes]]:
    """The writes that store a state read from the old form: records, batches, head last
    (a crash before the head leaves the old form in charge, and this is done again)."""
    st = rec.state
    writes = [(group_key(g), dump_settled(0, s, v)) for g, (s, v) in st.settled.items()]
    first = max(0, st.answered - len(rec.pending))
    writes += [
        (group_key(gid), dump_accepted(first + 1 + i, seq))
        for i, (gid, seq) in enumerate(rec.pending)
    ]
    writes += [(batch_key(s), dump_batch(at, q)) for s, at, q in rec.unpublished]
    return [*writes, (HEAD_KEY, dump_head(st, rec.published))]

"""The buffer's persisted state (services/buffer/state.py, store.py) without a server.

The store's journal runs against a hand-written in-memory bucket with the KV
stream's semantics (a put replaces its key under a new revision; a purge
removes the `r.>` keys below a revision), and every crash point — every
prefix of the writes — must recover a state that neither loses an acked
decision nor trains a group twice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.buffer.admission import Policy
from services.buffer.core import Assembler, BufferState, Cursor, Verdict
from services.buffer.state import (
    HEAD_KEY,
    OUTBOX_KEY,
    STATE_KEY,
    BufferRecordError,
    BufferStateError,
    batch_key,
    dump_accepted,
    dump_batch,
    dump_head,
    dump_outbox,
    dump_settled,
    dump_state,
    gid_of,
    group_key,
    load_head,
    new_form,
    recover,
)
from services.buffer.store import StateStore
from tests.unit.buffer.test_core import group


# ── the codec ──
@given(st.text(min_size=1, max_size=80))
def test_record_keys_carry_any_group_id(gid: str) -> None:
    key = group_key(gid)
    assert all(c.isalnum() or c in "-_=." for c in key)
    assert gid_of(key) == gid


def test_head_round_trips_and_is_checked() -> None:
    state = BufferState(Cursor(2, 9), dispatched=50, answered=41, next_step=7, ready_version=6)
    assert load_head(dump_head(state, 6)) == (state, 6)
    with pytest.raises(BufferStateError, match="published"):
        load_head(dump_head(state, 8))
    with pytest.raises(BufferStateError, match="answered 41 > dispatched 40"):
        load_head(dump_head(BufferState(dispatched=40, answered=41), 0))


def test_recover_merges_head_batches_and_records() -> None:
    head = BufferState(Cursor(0, 20), dispatched=20, answered=9, next_step=1, ready_version=1)
    entries = {
        HEAD_KEY: dump_head(head, 1),  # written after batch 1 was decided, before published
        batch_key(1): dump_batch(5.0, [11, 12]),
        group_key("a"): dump_accepted(10, 11),
        group_key("b"): dump_accepted(12, 12),
        group_key("c"): dump_settled(11, 1, "zero_variance"),
        group_key("e"): dump_accepted(14, 15),  # pending, decided after d
        group_key("d"): dump_accepted(13, 14),
    }
    rec = recover(entries)
    assert rec.state.next_step == 2  # the batch key says step 1 was decided
    assert rec.state.answered == 14  # the newest record's count
    assert rec.state.settled == {"a": (1, "accepted"), "b": (1, "accepted"),
                                 "c": (1, "zero_variance")}  # fmt: skip
    assert rec.pending == [("d", 14), ("e", 15)]  # in decision order
    assert rec.unpublished == [(1, 5.0, [11, 12])]
    assert (rec.published, rec.fresh, rec.migrate) == (1, False, False)
    assert recover({}).fresh


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (group_key("g"), b"\xc1", "not MessagePack"),
        (group_key("g"), msgpack.packb({"n": 1}), "needs seq, or step and v"),
        (group_key("g"), msgpack.packb({"n": -1, "seq": 3}), "n must be an integer"),
        ("r.g.!!!", dump_accepted(1, 2), "group id"),
        ("r.b.x", dump_batch(1.0, [1]), "not a batch key"),
        (batch_key(3), msgpack.packb({"at": "now", "seqs": [1]}), "at must be a number"),
        (HEAD_KEY, msgpack.packb([1, 2]), "must be a map"),
    ],
)
def test_a_corrupt_key_is_named(key: str, value: bytes, reason: str) -> None:
    with pytest.raises(BufferRecordError, match=reason) as e:
        recover({HEAD_KEY: dump_head(BufferState(dispatched=9), 0), key: value})
    assert e.value.key == key


def test_the_old_form_is_read_then_written_anew() -> None:
    old = BufferState(Cursor(1, 3), dispatched=30, answered=27, next_step=5, ready_version=4,
                      settled={"x": (4, "accepted"), "y": (4, "stale")})  # fmt: skip
    entries = {
        STATE_KEY: dump_state(old, [("p", 40), ("q", 41)]),
        OUTBOX_KEY: dump_outbox([(4, 2.5, [38, 39]), (5, 3.0, [40, 41])]),  # 5: never counted
    }
    rec = recover(entries)
    assert rec.migrate and rec.old_keys == [STATE_KEY, OUTBOX_KEY]
    assert rec.unpublished == [(4, 2.5, [38, 39])]
    again = recover(dict(new_form(rec)))
    assert not again.migrate
    assert (again.state, again.pending, again.unpublished) == (rec.state, rec.pending,
                                                               rec.unpublished)  # fmt: skip
    assert again.pending == [("p", 40), ("q", 41)]


# ── the journal, at every crash point ──
@dataclass
class Bucket:
    """A KV bucket as its stream: key -> (revision, value), history 1."""

    keys: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    rev: int = 0
    log: list[tuple[str, object]] = field(default_factory=list)  # every write, in order

    async def put(self, key: str, value: bytes) -> int:
        self.rev += 1
        self.keys[key] = (self.rev, value)
        self.log.append(("put", (key, value)))
        return self.rev

    async def purge_stream(self, stream: str, *, subject: str, seq: int) -> bool:
        assert subject.endswith(".r.>")
        self.keys = {k: v for k, v in self.keys.items() if not k.startswith("r.") or v[0] >= seq}
        self.log.append(("purge", seq))
        return True

    @staticmethod
    def replay(log: list[tuple[str, object]]) -> dict[str, bytes]:
        b = Bucket()
        for op, arg in log:
            asyncio.run(b.put(*arg) if op == "put" else b.purge_stream("", subject=".r.>", seq=arg))  # type: ignore[misc, arg-type]
        return {k: v for k, (_, v) in b.keys.items()}


def drive(arrivals: list[tuple[int, bool]], g: int) -> tuple[Bucket, list[list[str]], list[str]]:
    """What services/buffer/app.py writes per group (record, batch key, head, forget),
    with every write stored at once. Returns the bucket, the batches, the accepted ids."""
    bucket = Bucket()
    store = StateStore(bucket, bucket, "b")  # type: ignore[arg-type]
    asm = Assembler(Policy(g, max_staleness=99), BufferState(dispatched=10**6))
    batches: list[list[str]] = []
    accepted: list[str] = []
    seqs: dict[str, int] = {}
    for i, (version, varied) in enumerate(arrivals):
        gid = f"g{i}"
        verdict = asm.offer(group(gid, version, (0.0, 1.0) if varied else (1.0, 1.0)))
        if verdict == Verdict.ACCEPTED:
            seqs[gid] = 100 + i
            accepted.append(gid)
            store.group(gid, dump_accepted(asm.state.answered, seqs[gid]))
        else:
            store.group(gid, dump_settled(asm.state.answered, *asm.state.settled[gid]))
        while (b := asm.take_batch()) is not None:
            batches.append([x.group_id for x in b[1]])
            store.batch(b[0], float(b[0]), [seqs[x.group_id] for x in b[1]])
            store.head(dump_head(asm.state, asm.state.next_step))
        asm.forget_before(asm.state.next_step - 2)
        pending = [p.group_id for p in asm.pending]
        store.forget(
            asm.state, pending, asm.forgotten_below, dump_head(asm.state, asm.state.next_step)
        )
        asyncio.run(store.flush())
    return bucket, batches, accepted


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=40),
       st.integers(1, 4))  # fmt: skip
def test_every_crash_point_recovers_the_decisions_stored(
    arrivals: list[tuple[int, bool]], g: int
) -> None:
    bucket, batches, accepted = drive(arrivals, g)
    for k in range(len(bucket.log) + 1):
        rec = recover(Bucket.replay(bucket.log[:k]))
        settled = rec.state.settled
        pending = [gid for gid, _ in rec.pending]
        assert not set(pending) & set(settled), f"crash after write {k}: pending and settled"
        # Every batch the state counts is the batch that was decided (none rebuilt
        # differently), and the groups still to batch come in decision order.
        for step in range(rec.state.next_step - 2, rec.state.next_step):
            if step >= 0:
                got = sorted(x for x, (s, v) in settled.items() if s == step and v == "accepted")
                assert got == sorted(batches[step]), f"crash after write {k}: batch {step}"
        following = accepted[rec.state.next_step * g :]
        assert pending == following[: len(pending)], f"crash after write {k}: pending order"
    final = recover(Bucket.replay(bucket.log))
    assert final.state.next_step == len(batches)
    assert final.state.answered == len(arrivals)


def test_forgetting_purges_old_records_and_keeps_the_rest() -> None:
    bucket, batches, _ = drive([(0, i % 3 != 0) for i in range(60)], g=4)
    rec = recover({k: v for k, (_, v) in bucket.keys.items()})
    kept_steps = {s for s, _ in rec.state.settled.values()}
    assert min(kept_steps) >= len(batches) - 3  # two steps back, and the current one
    assert len(bucket.keys) < 20  # 60 decisions, 13 batches: most purged
    assert rec.state.answered == 60

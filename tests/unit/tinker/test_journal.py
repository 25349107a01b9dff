"""The journal's pure parts: records to bytes and back (whole and chunked), the replay's
plan, where a start begins (the newest whole checkpoint, a fallback, or a clear stop),
and what the request log and registry give a replay (the logged ids, the seed, a
checkpoint's copy of the log); a checkpoint directory's wholeness check."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from proto.chunking import Reassembler, split
from services.tinker.core import Registry, RequestLog, State, adapter_seed
from services.tinker.journal import (
    Checkpoint,
    Intake,
    JournalCorrupt,
    JournalIncomplete,
    Outcome,
    Record,
    decode,
    encode,
    plan,
    plan_start,
    record_id,
)

FB = Intake("req-a-2", "/api/v1/forward_backward", b"\x0a\x03pb\x00", reads_only=False)
FWD = Intake("req-a-3", "/api/v1/forward_backward", b"\x0a\x01", reads_only=True)
SESSION = Intake("session-a-1", "/api/v1/create_session", b"{}")


@pytest.mark.parametrize(
    "record",
    [
        FB,
        SESSION,
        Outcome("req-a-2", False, b"\x00protobuf\xff"),
        Outcome("req-a-4", False, {"metrics": {"grad_norm:mean": 0.1 + 0.2}, "type": None}),
        Outcome("req-a-5", True, error="loss_fn 'nope' is not a loss", category="user"),
        Checkpoint("000000000042", 42),
    ],
)
def test_a_record_comes_back_as_it_was_written(record: Record) -> None:
    assert decode(encode(record)) == record


def test_bytes_and_text_results_stay_apart() -> None:
    # A protobuf answer is sent as bytes, a JSON one as a dict: the record keeps which.
    assert isinstance(decode(encode(Outcome("r", False, b"abc"))).result, bytes)  # type: ignore[union-attr]
    assert decode(encode(Outcome("r", False, "abc"))).result == "abc"  # type: ignore[union-attr]


def test_a_record_over_max_payload_travels_in_chunks_and_joins() -> None:
    big = Outcome("req-a-9", False, bytes(range(256)) * 20_000)  # 5 MB
    parts = split(encode(big), record_id(big), max_payload=1 << 20)
    assert len(parts) == 5 and all(len(p) <= 1 << 20 for p in parts)
    joiner = Reassembler()
    wholes = [w for w in map(joiner.feed, parts) if w is not None]
    assert [decode(w) for w in wholes] == [big]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xc1", "not MessagePack"),
        (msgpack.packb([1, 2]), "not a tinker record"),
        (msgpack.packb({"type": "weights.published", "v": 1}), "not a tinker record"),
        (msgpack.packb({"type": "tinker.intake", "v": 2}), "version 2"),
        (msgpack.packb({"type": "tinker.outcome", "v": 1, "id": "r"}), "lacks"),
    ],
)
def test_what_is_not_a_record_is_refused_naming_its_sequence(data: bytes, why: str) -> None:
    with pytest.raises(JournalCorrupt, match=f"sequence 7.*{why}"):
        decode(data, seq=7)


def test_the_plan_keeps_log_order_once_each_and_tells_reads_and_unfinished_apart() -> None:
    records: list[Intake | Outcome] = [
        SESSION,
        FB,
        FWD,
        Outcome(FWD.request_id, False, b"fwd"),
        FB,  # the same intake appended twice (a resend past the duplicate window)
        Outcome(FB.request_id, False, b"first"),
        Outcome(FB.request_id, False, b"second"),
    ]
    replay = plan(records)
    assert replay.intakes == [SESSION, FB, FWD]
    assert replay.outcomes[FB.request_id].result == b"first"  # the first answer stands
    assert replay.answered_from_record(FWD)  # a read with its answer: not run again
    assert not replay.answered_from_record(FB)  # a step: run again to rebuild the state
    assert replay.unfinished == [SESSION]  # no outcome (a session is answered at once)
    # A read logged but cut off before its answer runs after the restart.
    assert not plan([FWD]).answered_from_record(FWD)


def test_outcomes_compare_by_answer() -> None:
    a = Outcome("r", False, {"metrics": {"loss:sum": 1.5}})
    assert a.same(Outcome("r", False, {"metrics": {"loss:sum": 1.5}}))
    assert not a.same(Outcome("r", False, {"metrics": {"loss:sum": 1.25}}))
    assert not a.same(Outcome("r", True, error="x", category="user"))


def test_a_replayed_request_keeps_its_logged_id_and_new_ones_never_collide() -> None:
    before, after = RequestLog(), RequestLog()  # two server starts
    first, fresh = before.open("m", "train", 1)
    assert fresh
    after.next_id = first.request_id  # what the replay sets
    replayed, _ = after.open("m", "train", 1)
    assert replayed.request_id == first.request_id and after.next_id is None
    retry, fresh = after.open("m", "train", 1)
    assert (retry, fresh) == (replayed, False)  # a retry after the restart: the same future
    new, _ = after.open("m", "train", 2)
    assert new.request_id not in (first.request_id,) and after.known(new.request_id)


def test_a_request_the_journal_refused_is_forgotten() -> None:
    log = RequestLog()
    entry, _ = log.open("m", "train", 1)
    log.forget(entry)
    assert not log.known(entry.request_id)
    again, fresh = log.open("m", "train", 1)
    assert fresh and again.request_id != entry.request_id


def test_a_replayed_session_keeps_its_id() -> None:
    registry = Registry()
    assert registry.new_session("session-old-1") == "session-old-1"
    registry.session("session-old-1")  # known
    new = registry.new_session()
    assert new != "session-old-1"
    registry.end_session(new)
    assert new not in registry.sessions


def test_an_unseeded_adapter_is_seeded_from_its_request() -> None:
    assert adapter_seed(0, "s-1:train:0") == adapter_seed(0, "s-1:train:0")
    assert adapter_seed(0, "s-1:train:0") != adapter_seed(0, "s-1:train:1")
    assert adapter_seed(0, "s-1:train:0") != adapter_seed(1, "s-1:train:0")


STEP = Intake("req-a-6", "/api/v1/optim_step", b"{}")
LATER = Intake("req-a-7", "/api/v1/optim_step", b"{}")


def _stream() -> list[tuple[int, Record]]:
    """create_session, a forward_backward, checkpoint 1 (covering 3), a step, checkpoint 2
    (covering 6), a later step: as sequences on a stream."""
    return [
        (1, SESSION),
        (2, FB),
        (3, Outcome(FB.request_id, False, b"x")),
        (4, Checkpoint("c3", 3)),
        (5, STEP),
        (6, Outcome(STEP.request_id, False, {})),
        (7, Checkpoint("c6", 6)),
        (8, LATER),
    ]


def test_a_start_loads_the_newest_whole_checkpoint_and_replays_what_followed() -> None:
    start = plan_start(_stream(), 1, lambda cp: None)
    assert start.checkpoint == Checkpoint("c6", 6)
    assert start.replay.intakes == [LATER] and start.replay.unfinished == [LATER]
    assert start.passed_over == []


def test_a_checkpoint_not_whole_falls_back_to_the_one_before() -> None:
    start = plan_start(_stream(), 4, lambda cp: "gone" if cp.directory == "c6" else None)
    assert start.checkpoint == Checkpoint("c3", 3)
    assert start.replay.intakes == [STEP, LATER]  # the checkpoint records are no requests
    assert start.passed_over == ["checkpoint 'c6' (to sequence 6): gone"]


def test_with_no_checkpoint_whole_the_full_log_when_nothing_was_purged() -> None:
    start = plan_start(_stream(), 1, lambda cp: "gone")
    assert start.checkpoint is None
    assert start.replay.intakes == [SESSION, FB, STEP, LATER]
    assert len(start.passed_over) == 2


def test_a_purged_stream_without_a_whole_checkpoint_stops_naming_what_is_missing() -> None:
    purged = [r for r in _stream() if r[0] >= 5]
    # c3's directory is whole, but the records after it are gone (the stream starts at 5).
    with pytest.raises(JournalIncomplete, match="before sequence 5 were purged") as info:
        plan_start(purged, 5, lambda cp: "dir missing" if cp.directory == "c6" else None)
    assert "'c6' (to sequence 6): dir missing" in str(info.value)
    with pytest.raises(JournalIncomplete, match="no checkpoint record is on the stream"):
        plan_start([(9, LATER)], 9, lambda cp: None)


def test_a_checkpoint_copy_of_the_request_log_keeps_answers_and_retries() -> None:
    log = RequestLog()
    done, _ = log.open("model-1", "train", 1)
    log.complete(done, {"metrics": {}})
    pending, _ = log.open("model-1", "train", 2)
    entries, keys = log.entries()
    again = RequestLog()
    again.restore(entries, keys)
    assert again.get(done.request_id).result == {"metrics": {}}
    assert again.open("model-1", "train", 1) == (done, False)  # a retry: not run again
    again.expire({done.request_id, pending.request_id}, "expired")
    assert again.get(done.request_id).state is State.FAILED
    assert again.get(done.request_id).error == "expired"
    assert again.get(pending.request_id).state is State.PENDING  # only answered ones
    assert again.open("model-1", "train", 1)[1] is False


def test_a_checkpoint_directory_is_whole_only_as_written(tmp_path: Path) -> None:
    from services.tinker.checkpoint import Captured, CheckpointStore
    from services.tinker.core import Entry

    store = CheckpointStore(tmp_path / "stream")
    entry = Entry("req-a-1", "train", "model-1", State.DONE, b"\x01\x02")
    captured = Captured(7, "tiny", {"s": []}, [], [], {}, [entry], {"req-a-1": ("m", "train", 1)})
    cp = store.write(captured)
    assert cp == Checkpoint("000000000007", 7) and store.why_not_whole(cp) is None
    back = store.read(cp)
    assert back.entries == [entry] and back.keys == captured.keys and back.covers == 7
    state = tmp_path / "stream" / cp.directory / "state.msgpack"
    state.write_bytes(state.read_bytes()[:-1])  # cut short
    assert "not the file that was written" in (store.why_not_whole(cp) or "")
    (tmp_path / "stream" / cp.directory / "manifest.json").unlink()
    assert "has no manifest.json" in (store.why_not_whole(cp) or "")
    assert "is missing" in (store.why_not_whole(Checkpoint("000000000009", 9)) or "")

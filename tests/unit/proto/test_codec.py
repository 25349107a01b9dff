"""The wire contract: round trips, golden bytes, and every kind of ProtocolError."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import codec
from proto.chunking import Reassembler, split
from proto.errors import (
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaViolation,
    UnknownSchemaVersion,
    WrongMessageType,
)
from proto.examples import EXAMPLES
from proto.messages import (
    MESSAGE_TYPES,
    Chunk,
    DeadLetter,
    EngineHeartbeat,
    EvalRequest,
    EvalResult,
    FinishReason,
    PromptTask,
    Sample,
    SampleGroup,
    SamplingParams,
    TaskEvalResult,
    TrainBatch,
    WeightsChunk,
    WeightsPublished,
    WeightsReady,
    pack_f32,
    pack_i32,
    pack_u8,
    unpack_f32,
    unpack_i32,
)

GOLDEN = Path(__file__).parents[2] / "fixtures" / "golden"

ids = st.from_regex(r"[A-Za-z0-9:_-]{1,40}", fullmatch=True)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
versions = st.integers(0, 2**31)
sha = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 64))
    v = draw(versions)
    return Sample(
        sample_id=draw(ids),
        group_id=draw(ids),
        task_id=draw(ids),
        index=draw(st.integers(0, 1000)),
        attempt=draw(st.integers(0, 10)),
        prompt_ids=pack_i32(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=32))),
        response_ids=pack_i32(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))),
        logprobs=pack_f32(draw(st.lists(finite, min_size=n, max_size=n))),
        loss_mask=pack_u8(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))),
        reward=draw(finite),
        reward_parts=draw(st.dictionaries(ids, finite, max_size=3)),
        finish_reason=draw(st.sampled_from(FinishReason)),
        weight_version=v,
        weight_version_last=v + draw(st.integers(0, 3)),
        engine_id=draw(ids),
        queued_at=draw(times),
        started_at=draw(times),
        finished_at=draw(times),
        verifier_error=draw(st.none() | st.text(max_size=40)),
    )


@st.composite
def groups(draw: st.DrawFn) -> SampleGroup:
    return SampleGroup(
        run=draw(ids),
        group_id=draw(ids),
        task_id=draw(ids),
        task_name=draw(ids),
        worker_id=draw(ids),
        samples=tuple(draw(st.lists(samples(), min_size=1, max_size=3))),
        created_at=draw(times),
    )


STRATEGIES = {
    "PromptTask": st.builds(
        PromptTask,
        run=ids,
        task_id=ids,
        epoch=st.integers(0, 100),
        index=st.integers(0, 10**6),
        task_name=ids,
        prompt=st.text(max_size=50),
        messages=st.none()
        | st.lists(st.fixed_dictionaries({"role": ids, "content": st.text()}), max_size=3).map(
            tuple
        ),
        answer=st.none() | st.text(max_size=20),
        n=st.integers(1, 64),
        sampling=st.builds(
            SamplingParams,
            temperature=st.floats(0, 2),
            top_p=st.floats(0.01, 1),
            top_k=st.integers(-1, 100),
            max_new_tokens=st.integers(1, 4096),
            stop=st.lists(st.text(min_size=1, max_size=3), max_size=2).map(tuple),
        ),
        min_weight_version=versions,
        attempt=st.integers(0, 5),
        created_at=times,
    ),
    "Sample": samples(),
    "SampleGroup": groups(),
    "TrainBatch": st.builds(
        TrainBatch,
        run=ids,
        batch_id=ids,
        step=st.integers(0, 10**6),
        groups=st.lists(groups(), min_size=1, max_size=2).map(tuple),
        created_at=times,
    ),
    "WeightsPublished": st.builds(
        WeightsPublished,
        run=ids,
        version=versions,
        step=st.integers(0, 10**6),
        uri=st.text(min_size=1, max_size=40),
        sha256=sha,
        size_bytes=st.integers(0, 2**40),
        published_at=times,
    ),
    "WeightsReady": st.builds(
        WeightsReady, run=ids, version=versions, engines=st.lists(ids, max_size=4).map(tuple)
    ),
    "EvalRequest": st.builds(EvalRequest, run=ids, version=versions, requested_at=times),
    "EvalResult": st.builds(
        EvalResult,
        run=ids,
        version=versions,
        outcome=st.just("evaluated"),
        tasks=st.lists(
            st.builds(
                TaskEvalResult,
                name=ids,
                total=st.integers(0, 10**6),
                pass_at_1=st.floats(0.0, 1.0),
                mean_reward=st.floats(-10.0, 10.0),
                k=st.integers(1, 64),
                pass_at_k=st.none() | st.floats(0.0, 1.0),
            ),
            min_size=1,
            max_size=3,
        ).map(tuple),
        engines=st.lists(ids, max_size=4).map(tuple),
        finished_at=times,
    )
    | st.builds(
        EvalResult,
        run=ids,
        version=versions,
        outcome=st.sampled_from(["skipped", "aborted"]),
        reason=st.text(max_size=100),
    ),
    "EngineHeartbeat": st.builds(
        EngineHeartbeat,
        run=ids,
        engine_id=ids,
        url=st.text(min_size=1, max_size=30),
        worker_id=ids,
        weight_version=versions,
        running=st.integers(0, 1000),
        queued=st.integers(0, 1000),
        sent_at=times,
        local_weights_dir=st.none() | st.text(min_size=1, max_size=40),
        downloaded_version=st.none() | versions,
    ),
    "DeadLetter": st.builds(
        DeadLetter,
        run=ids,
        reason=ids,
        error=st.text(max_size=80),
        subject=st.text(max_size=40),
        message_type=st.text(max_size=20),
        payload=st.binary(max_size=200),
        service=st.text(max_size=10),
        delivered=st.integers(0, 100),
        at=times,
    ),
    "Chunk": st.integers(1, 5).flatmap(
        lambda count: st.builds(
            Chunk,
            of=ids,
            index=st.integers(0, count - 1),
            count=st.just(count),
            total_size=st.integers(0, 10**9),
            sha256=sha,
            data=st.binary(max_size=100),
        )
    ),
    "WeightsChunk": st.integers(1, 5).flatmap(
        lambda count: st.builds(
            WeightsChunk,
            run=ids,
            version=versions,
            sha256=sha,
            file=st.lists(
                st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True), min_size=1, max_size=3
            )
            .filter(lambda parts: all(p not in (".", "..") for p in parts))
            .map("/".join),
            offset=st.integers(0, 2**40),
            index=st.integers(0, count - 1),
            count=st.just(count),
            data=st.binary(max_size=100),
        )
    ),
}


def test_every_message_type_has_a_strategy_and_an_example() -> None:
    assert set(STRATEGIES) == set(MESSAGE_TYPES) == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(MESSAGE_TYPES))
def test_round_trip_property(name: str) -> None:
    cls = MESSAGE_TYPES[name]

    @settings(max_examples=60, deadline=None)
    @given(STRATEGIES[name])
    def check(msg: object) -> None:
        data = codec.encode(msg)  # type: ignore[arg-type]
        assert codec.decode(data, cls) == msg
        assert codec.decode_any(data) == msg

    check()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_golden_bytes(name: str) -> None:
    golden = (GOLDEN / f"{name}.msgpack").read_bytes()
    msg = EXAMPLES[name]
    assert codec.encode(msg) == golden
    assert codec.decode(golden, type(msg)) == msg


def test_packed_arrays_are_little_endian() -> None:
    assert pack_i32([1, -2]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
    assert pack_f32([1.0]) == b"\x00\x00\x80\x3f"
    s = EXAMPLES["Sample"]
    assert isinstance(s, Sample)
    assert unpack_i32(s.response_ids).tolist() == [8, 3, 1]
    np.testing.assert_array_equal(unpack_f32(s.logprobs), np.array([-0.5, -1.25, -0.125], "f4"))


def _body(name: str) -> dict:
    return msgpack.unpackb(codec.encode(EXAMPLES[name]), raw=False)


def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def test_truncated_bytes() -> None:
    data = codec.encode(EXAMPLES["Sample"])
    with pytest.raises(MalformedMessage) as e:
        codec.decode(data[: len(data) // 2], Sample)
    assert e.value.message_type == "Sample"
    assert e.value.reason == "malformed"


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"hello world", _pack([1, 2, 3])])
def test_garbage(garbage: bytes) -> None:
    with pytest.raises(MalformedMessage):
        codec.decode(garbage, PromptTask)


def test_missing_required_field_is_named() -> None:
    body = _body("Sample")
    del body["reward"]
    with pytest.raises(SchemaViolation) as e:
        codec.decode(_pack(body), Sample)
    assert (e.value.message_type, e.value.field) == ("Sample", "reward")


def test_wrong_type_is_named() -> None:
    body = _body("WeightsPublished")
    body["version"] = "four"
    with pytest.raises(SchemaViolation) as e:
        codec.decode(_pack(body), WeightsPublished)
    assert e.value.field == "version"
    assert "WeightsPublished.version" in str(e.value)


def test_misaligned_arrays_rejected() -> None:
    body = _body("Sample")
    body["logprobs"] = body["logprobs"][:4]
    with pytest.raises(SchemaViolation, match="logprobs"):
        codec.decode(_pack(body), Sample)
    body = _body("Sample")
    body["response_ids"] = body["response_ids"][:-1]
    with pytest.raises(SchemaViolation) as e:
        codec.decode(_pack(body), Sample)
    assert e.value.field == "response_ids"


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": 3, "start": 0, "end": 2}],  # covers 2 of 3 tokens
        [{"version": 3, "start": 1, "end": 3}],  # does not start at 0
        [{"version": 4, "start": 0, "end": 1}, {"version": 3, "start": 1, "end": 3}],  # falls
        [{"version": 3, "start": 0, "end": 3}],  # last is not weight_version_last (4)
    ],
)
def test_version_spans_must_cover_the_response_in_order(spans: list[dict[str, int]]) -> None:
    body = _body("Sample")
    body["weight_version_last"] = 4
    body["weight_version_spans"] = spans
    with pytest.raises(SchemaViolation) as e:
        codec.decode(_pack(body), Sample)
    assert e.value.field == "weight_version_spans"


def test_a_1_0_sample_without_spans_still_decodes() -> None:
    body = _body("Sample")
    body["schema_version"] = "1.0"
    del body["weight_version_spans"]
    assert codec.decode(_pack(body), Sample).weight_version_spans == ()


def test_unknown_major_version_rejected_minor_tolerated() -> None:
    body = _body("WeightsReady")
    body["schema_version"] = "2.0"
    with pytest.raises(UnknownSchemaVersion, match="major version '2'"):
        codec.decode(_pack(body), WeightsReady)
    body["schema_version"] = "1.7"
    body["a_field_from_the_future"] = [1, 2]
    msg = codec.decode(_pack(body), WeightsReady)
    assert msg.version == EXAMPLES["WeightsReady"].version  # type: ignore[attr-defined]


def test_wrong_message_type() -> None:
    with pytest.raises(WrongMessageType, match="'PromptTask'"):
        codec.decode(codec.encode(EXAMPLES["PromptTask"]), SampleGroup)


def test_oversized_message_refused_at_encode() -> None:
    n = 300_000
    big = EXAMPLES["Sample"].model_copy(  # type: ignore[union-attr]
        update={
            "response_ids": pack_i32(np.zeros(n)),
            "logprobs": pack_f32(np.zeros(n)),
            "loss_mask": pack_u8(np.ones(n)),
        }
    )
    with pytest.raises(MessageTooLarge) as e:
        codec.encode(big)
    assert e.value.size > e.value.limit == codec.DEFAULT_MAX_PAYLOAD
    assert isinstance(e.value, ProtocolError)


def test_32k_token_sample_fits_default_max_payload() -> None:
    n = 32_768
    s = EXAMPLES["Sample"].model_copy(  # type: ignore[union-attr]
        update={
            "prompt_ids": pack_i32(np.arange(2048)),
            "response_ids": pack_i32(np.arange(n)),
            "logprobs": pack_f32(np.zeros(n)),
            "loss_mask": pack_u8(np.ones(n)),
        }
    )
    assert len(codec.encode(s)) < codec.DEFAULT_MAX_PAYLOAD


def test_message_ids_are_deterministic() -> None:
    for msg in EXAMPLES.values():
        assert codec.message_id(msg) == codec.message_id(codec.decode_any(codec.encode(msg)))
    assert codec.message_id(EXAMPLES["TrainBatch"]) == "golden:step3"


def _batch(groups: int, tokens: int) -> TrainBatch:
    base = EXAMPLES["Sample"]
    assert isinstance(base, Sample)
    s = base.model_copy(
        update={
            "response_ids": pack_i32(np.arange(tokens)),
            "logprobs": pack_f32(np.zeros(tokens)),
            "loss_mask": pack_u8(np.ones(tokens)),
        }
    )
    g = SampleGroup(
        run="r", group_id="g", task_id="t", task_name="e", worker_id="w", samples=(s,) * 8
    )
    return TrainBatch(run="r", batch_id="r:step0", step=0, groups=(g,) * groups)


def test_large_batch_chunks_and_reassembles_in_any_order() -> None:
    batch = _batch(groups=40, tokens=4096)  # 320 samples x 4k tokens, ~12 MB
    data = codec.encode(batch, max_payload=None)
    limit = codec.DEFAULT_MAX_PAYLOAD
    parts = split(data, "r:step0", limit)
    assert len(parts) > 1 and all(len(p) <= limit for p in parts)
    r = Reassembler()
    order = [*reversed(parts), parts[0]]  # out of order, with a redelivery
    out = [r.feed(p) for p in order]
    whole = [o for o in out if o is not None]
    assert len(whole) == 1 and r.pending == 0
    assert codec.decode(whole[0], TrainBatch) == batch


def test_small_message_passes_through_reassembler() -> None:
    data = codec.encode(EXAMPLES["WeightsReady"])
    assert split(data, "x", codec.DEFAULT_MAX_PAYLOAD) == [data]
    assert Reassembler().feed(data) == data


def test_corrupted_chunk_is_detected() -> None:
    data = codec.encode(_batch(groups=4, tokens=4096), max_payload=None)
    parts = split(data, "b", 64 * 1024)
    body = msgpack.unpackb(parts[1], raw=False)
    body["data"] = bytes(len(body["data"]))
    parts[1] = _pack(body)
    r = Reassembler()
    with pytest.raises(ProtocolError, match="sha256"):
        for p in parts:
            r.feed(p)


def test_discard_lets_a_redelivered_message_reassemble_again() -> None:
    data = codec.encode(_batch(groups=4, tokens=4096), max_payload=None)
    parts = split(data, "b", 64 * 1024)
    r = Reassembler()
    assert [r.feed(p) for p in parts][-1] == data
    assert r.feed(parts[0]) is None  # a stray late duplicate is ignored
    r.discard("b")  # handling failed: every part comes again
    assert [r.feed(p) for p in parts][-1] == data


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../b", "a//b", "./a"])
def test_weights_chunk_rejects_paths_outside_its_directory(bad: str) -> None:
    good = EXAMPLES["WeightsChunk"]
    body = msgpack.unpackb(codec.encode(good))
    body["file"] = bad
    with pytest.raises(SchemaViolation):
        codec.decode(msgpack.packb(body, use_bin_type=True), WeightsChunk)


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        ("logprob", float("nan"), "groups.0.samples.1.logprobs"),
        ("logprob", float("-inf"), "groups.0.samples.1.logprobs"),
        ("reward", float("inf"), "groups.0.samples.1.reward"),
    ],
)
def test_train_batch_with_non_finite_values_names_the_field(where, value, field) -> None:
    ex = EXAMPLES["TrainBatch"]
    group = ex.groups[0]
    sample = group.samples[0]
    n = sample.num_response_tokens
    bad = sample.model_copy(
        update={"logprobs": pack_f32([value] + [-1.0] * (n - 1)), "loss_mask": pack_u8([0] * n)}
        if where == "logprob"  # on a masked position: weight 0 · NaN is still NaN
        else {"reward": value}
    )
    batch = ex.model_copy(update={"groups": (group.model_copy(update={"samples": (sample, bad)}),)})
    data = codec.encode(batch)  # model_copy skips validation: the bytes a faulty producer sends
    with pytest.raises(SchemaViolation) as e:
        codec.decode(data, TrainBatch)
    assert e.value.field == field and e.value.reason == "schema"
    with pytest.raises(SchemaViolation) as e:  # the buffer refuses the sample group already
        codec.decode(codec.encode(batch.groups[0]), SampleGroup)
    assert e.value.field == field.removeprefix("groups.0.")
    assert codec.decode(codec.encode(ex), TrainBatch) == ex


def test_an_evaluation_result_has_figures_exactly_when_evaluated() -> None:
    """An EvalResult that says `evaluated` carries its figures; a skipped or aborted one
    carries none (the trainer writes a row from the figures, a log line from the reason)."""
    good = EXAMPLES["EvalResult"]
    assert codec.message_id(good) == "golden:evaluated:validation:v4"
    assert codec.message_id(EXAMPLES["EvalRequest"]) == "golden:evaluate:validation:v4"
    body = _body("EvalResult")
    body["tasks"] = []
    with pytest.raises(SchemaViolation, match="tasks"):
        codec.decode(_pack(body), EvalResult)
    body = _body("EvalResult")
    body["outcome"] = "skipped"
    with pytest.raises(SchemaViolation, match="tasks"):
        codec.decode(_pack(body), EvalResult)
    body["tasks"] = []
    body["reason"] = "the engines went from v3 to v5"
    assert codec.decode(_pack(body), EvalResult).outcome == "skipped"

"""The codec's fast paths keep the contract: reused packers, fields named in errors.

The encoder reuses a per-thread msgpack Packer and the decoder calls the
validator directly (proto/codec.py); these tests pin that no check is lost,
every error names its field (cross-field ones too), and no encode leaks into
the next.
"""

from __future__ import annotations

import threading

import msgpack
import pytest
from pydantic import ValidationError

from proto import codec
from proto.errors import SchemaViolation
from proto.examples import EXAMPLES
from proto.messages import Sample, SampleGroup, SamplingParams, TrainBatch, pack_i32


def _body(name: str) -> dict:
    return msgpack.unpackb(codec.encode(EXAMPLES[name]), raw=False)


def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_ids", b"\x01\x02\x03"),  # not whole <i4 items
        ("response_ids", b"\x01\x00\x00\x00\x02"),
        ("logprobs", b"\x00\x00\x80\x3f"),  # one entry for three tokens
        ("loss_mask", b"\x01"),
    ],
)
def test_each_packed_array_check_names_its_own_field(field: str, value: bytes) -> None:
    body = _body("Sample")
    body[field] = value
    with pytest.raises(SchemaViolation) as e:
        codec.decode(_pack(body), Sample)
    assert (e.value.message_type, e.value.field) == ("Sample", field)
    assert str(e.value).startswith(f"Sample.{field}: ")


def test_nested_sample_errors_name_the_path_inside_the_group() -> None:
    body = _body("SampleGroup")
    body["samples"][1]["loss_mask"] = b""
    with pytest.raises(SchemaViolation) as e:
        codec.decode(_pack(body), SampleGroup)
    assert (e.value.message_type, e.value.field) == ("SampleGroup", "samples.1.loss_mask")


def test_weight_version_order_is_still_checked() -> None:
    body = _body("Sample")
    body["weight_version_last"] = body["weight_version"] - 1
    with pytest.raises(SchemaViolation, match="weight_version_last") as e:
        codec.decode(_pack(body), Sample)
    assert e.value.field == "weight_version_last"


def test_constructing_an_inconsistent_sample_in_python_fails_too() -> None:
    s = EXAMPLES["Sample"]
    assert isinstance(s, Sample)
    fields = {**s.__dict__, "response_ids": pack_i32([1, 2])}  # 2 tokens, 3 logprobs
    with pytest.raises(ValidationError, match="logprobs"):
        Sample(**fields)


def test_reused_packer_recovers_from_a_failed_encode() -> None:
    group = EXAMPLES["SampleGroup"]
    good = codec.encode(group)
    # A value msgpack cannot pack, deep inside: the packer fails mid-message.
    broken = group.model_copy(update={"run": object()})
    with pytest.raises(TypeError):
        codec.encode(broken)
    assert codec.encode(group) == good  # nothing of the failed message leaks in


def test_encode_refuses_a_non_message() -> None:
    with pytest.raises(TypeError, match="SamplingParams"):
        codec.encode(SamplingParams())  # type: ignore[arg-type]


def test_a_huge_encode_does_not_change_later_bytes() -> None:
    batch = EXAMPLES["TrainBatch"]
    assert isinstance(batch, TrainBatch)
    group = batch.groups[0]
    big_sample = group.samples[0].model_copy(
        update={"prompt_ids": b"\x00" * (5 * 1024 * 1024), "response_ids": b"", "logprobs": b"",
                "loss_mask": b""}
    )  # fmt: skip
    big = group.model_copy(update={"samples": (big_sample,)})
    data = codec.encode(big, max_payload=None)
    assert len(data) > 5 * 1024 * 1024
    assert codec.decode(data, SampleGroup) == big
    assert codec.encode(batch) == codec.encode(batch.model_copy())


def test_threads_encoding_at_once_get_their_own_bytes() -> None:
    msgs = list(EXAMPLES.values())
    expected = [codec.encode(m) for m in msgs]
    failures: list[str] = []

    def work() -> None:
        for _ in range(200):
            for m, want in zip(msgs, expected, strict=True):
                if codec.encode(m) != want:
                    failures.append(m.TYPE)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []

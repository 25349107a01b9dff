"""The message loop's outcome policy and dead-letter building: pure, no server."""

from __future__ import annotations

import pytest

from proto.codec import decode
from proto.errors import MalformedMessage, SchemaViolation, UnknownSchemaVersion, WrongMessageType
from proto.messages import DeadLetter
from services.runtime.errors import PermanentError, RetryableError
from services.runtime.msgloop import Action, RetryPolicy, dead_letter, decide, header_safe


def test_success_is_acked():
    assert decide(None, delivered=1, max_deliver=5).action is Action.ACK


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (MalformedMessage("not msgpack", message_type="SampleGroup"), "malformed"),
        (SchemaViolation("missing", message_type="Sample", field="reward"), "schema"),
        (UnknownSchemaVersion("2.0", message_type="Sample"), "version"),
        (WrongMessageType("got WeightsReady", message_type="SampleGroup"), "wrong_type"),
        (PermanentError("too old", reason="stale"), "stale"),
        (KeyError("bug"), "handler_error"),
        (ZeroDivisionError("bug"), "handler_error"),
    ],
)
def test_bad_messages_and_bugs_are_dead_lettered_with_their_reason(error, reason):
    d = decide(error, delivered=1, max_deliver=5)
    assert d.action is Action.DEAD_LETTER
    assert d.reason == reason
    assert type(error).__name__ in d.error


def test_retryable_is_nacked_with_exponential_backoff_until_the_last_delivery():
    policy = RetryPolicy(base_s=1.0, cap_s=10.0)
    delays = [decide(RetryableError("busy"), n, 6, policy).delay_s for n in range(1, 6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0]
    assert all(decide(RetryableError("x"), n, 6, policy).action is Action.NAK for n in range(1, 6))
    last = decide(RetryableError("busy"), 6, 6, policy)
    assert last.action is Action.DEAD_LETTER and last.reason == "max_deliver"
    assert "6 deliveries" in last.error and "busy" in last.error


def test_retryable_delay_override_and_unlimited_deliveries():
    d = decide(RetryableError("loading weights", delay_s=0.25), 3, 10)
    assert d.action is Action.NAK and d.delay_s == 0.25
    # max_deliver <= 0 means unlimited: never given up
    assert decide(RetryableError("x"), 1000, -1).action is Action.NAK


def test_transport_errors_are_retried_not_dead_lettered_as_bugs():
    for error in (TimeoutError("publish timed out"), ConnectionResetError("peer reset")):
        d = decide(error, delivered=1, max_deliver=5)
        assert d.action is Action.NAK and d.delay_s == 1.0

    class BrokerDown(Exception):
        pass

    assert decide(BrokerDown(), 1, 5).reason == "handler_error"
    assert decide(BrokerDown(), 1, 5, transient=(BrokerDown,)).action is Action.NAK
    assert decide(TimeoutError(), 5, 5).reason == "max_deliver"


def test_header_safe_is_one_bounded_line():
    assert header_safe("a\r\nb\tc") == "a b c"
    long = header_safe("x" * 2000, limit=100)
    assert len(long) == 100 and long.endswith("…")


def test_dead_letter_keeps_the_original_bytes():
    payload = b"\xc1garbage"
    dl, data = dead_letter(
        run="r",
        reason="malformed",
        error="bad",
        subject="flywheel.r.samples",
        payload=payload,
        service="buffer",
        delivered=2,
        max_payload=1 << 20,
    )
    back = decode(data, DeadLetter)
    assert back == dl
    assert back.payload == payload and back.delivered == 2 and back.message_type == "?"


def test_dead_letter_of_an_oversized_message_is_cut_to_fit_and_says_where():
    payload = b"\x00" * 5000
    limit = 2000
    dl, data = dead_letter(
        run="r",
        reason="handler_error",
        error="bug",
        subject="s",
        payload=payload,
        service="svc",
        delivered=1,
        max_payload=limit,
        where="stream S seq 7",
    )
    assert len(data) <= limit
    assert 0 < len(dl.payload) < len(payload) and payload.startswith(dl.payload)
    assert "truncated from 5000 B" in dl.error and "stream S seq 7" in dl.error

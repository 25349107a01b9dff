"""The message loop's per-message economies keep their behaviour (no server needed).

`Delivery` reads JetStream metadata and headers lazily from the nats-py
message; heartbeats come from one timer per loop (`Heartbeats`) instead of
one per message. The real-server behaviour (a long handler is not
redelivered) is in tests/integration/runtime/test_msgloop.py.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.msg import Msg

from services.runtime.msgloop import ACK, Action, Delivery, Heartbeats, decide

# A JetStream reply subject: stream, consumer, delivered, stream seq, consumer seq, ts, pending.
REPLY = "$JS.ACK.FLYWHEEL_r_SAMPLES.buffer.3.1234.99.1732230000000000000.5"


def _msg(headers: dict[str, str] | None = None) -> Msg:
    return Msg(None, subject="flywheel.r.samples", reply=REPLY, data=b"x", headers=headers)  # type: ignore[arg-type]


def test_delivery_reads_jetstream_metadata_from_the_reply_subject() -> None:
    d = Delivery(_msg({"Nats-Msg-Id": "g1"}))
    assert (d.subject, d.delivered, d.stream_seq) == ("flywheel.r.samples", 3, 1234)
    assert "delivered=3" in repr(d) and "stream_seq=1234" in repr(d)


def test_delivery_headers_are_a_private_copy() -> None:
    msg = _msg({"Nats-Msg-Id": "g1"})
    d = Delivery(msg)
    d.headers["extra"] = "mine"
    assert d.headers == {"Nats-Msg-Id": "g1", "extra": "mine"}  # the same copy on every access
    assert msg.headers == {"Nats-Msg-Id": "g1"}
    assert Delivery(_msg(None)).headers == {}


def test_success_decision_is_one_shared_constant() -> None:
    assert decide(None, delivered=1, max_deliver=5) is ACK
    assert ACK.action is Action.ACK


class _Recorded(Delivery):
    """A Delivery whose in-progress acks are recorded instead of sent (the timer is under test)."""

    def __init__(self) -> None:
        super().__init__(_msg())
        self.beats: list[float] = []

    async def in_progress(self) -> None:
        self.beats.append(time.perf_counter())


def test_one_timer_beats_long_handlers_within_one_and_a_half_intervals(run_async) -> None:
    interval = 0.1

    async def body() -> None:
        hb = Heartbeats(interval, "test")
        slow, quick = _Recorded(), _Recorded()
        started = time.perf_counter()
        hb.add(slow, started)
        hb.add(quick, started)
        hb.discard(quick)  # finished at once: never beaten
        deadline = time.monotonic() + 5
        while len(slow.beats) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        hb.discard(slow)
        assert len(slow.beats) >= 4, slow.beats
        gaps = [b - a for a, b in zip([started, *slow.beats], slow.beats, strict=False)]
        # interval..1.5·interval by design; generous upper slack for a loaded machine
        assert all(g >= interval * 0.99 for g in gaps), gaps
        assert all(g < interval * 1.5 + 0.25 for g in gaps), gaps
        assert quick.beats == []
        # Idle: the timer is not re-armed after its next tick, and nothing more is sent.
        count = len(slow.beats)
        deadline = time.monotonic() + 5
        while hb._timer is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert hb._timer is None
        assert len(slow.beats) == count
        hb.close()

    run_async(body())


def test_close_cancels_the_timer(run_async) -> None:
    async def body() -> None:
        hb = Heartbeats(0.05, "test")
        d = _Recorded()
        hb.add(d, time.perf_counter())
        assert hb._timer is not None
        hb.close()
        assert hb._timer is None
        await asyncio.sleep(0.15)  # three intervals: a live timer would have beaten by now
        assert d.beats == []

    run_async(body())


def test_a_heartbeat_too_slow_for_the_ack_wait_is_refused() -> None:
    """Beats come 1–1.5 × heartbeat_s apart: 1.5 × must stay under the consumer's ack_wait."""
    import dataclasses

    import pytest
    from prometheus_client import CollectorRegistry

    from proto.messages import SampleGroup
    from proto.streams import consumers_for
    from services.runtime.msgloop import MessageLoop

    spec = dataclasses.replace(consumers_for("r")["buffer"], ack_wait_s=3.0)

    def make(heartbeat_s: float) -> MessageLoop[SampleGroup]:
        async def handle(_m: SampleGroup, _d: Delivery) -> None:
            return None

        return MessageLoop(
            None, spec, SampleGroup, handle, run="r", service="buffer",  # type: ignore[arg-type]
            registry=CollectorRegistry(), max_payload=1 << 20, heartbeat_s=heartbeat_s,
        )  # fmt: skip

    assert make(1.9).heartbeat_s == 1.9
    with pytest.raises(ValueError, match=r"heartbeat_s 2\.0"):
        make(2.0)

"""`flywheel status` shows what the newest weight version cost on the wire."""

from __future__ import annotations

from proto.codec import decode, encode
from proto.messages import WeightsPublished
from proto.wirecost import WireCost
from services.stack.inspect import render_status, wire_of


def status(msg: WeightsPublished) -> str:
    return render_status(
        {"run": "r", "streams": {}, "published": msg.version, "ready": 3, "wire": wire_of(msg)}
    )


def published(wire: WireCost | None) -> WeightsPublished:
    msg = WeightsPublished(
        run="r",
        version=4,
        step=4,
        uri="natsdelta://S/4?snapshot=1",
        sha256="a" * 64,
        size_bytes=3_200_000,
        wire=wire,
    )
    return decode(encode(msg, None), WeightsPublished)  # as read off the stream


def test_a_delta_version_shows_its_sizes_ratio_and_fraction_changed() -> None:
    cost = WireCost(sent_bytes=41_000, delta_bytes=41_000, changed_fraction=0.004, publish_s=0.05)
    line = status(published(cost)).splitlines()[2]
    assert line == (
        "  weights on the wire (newest): 3.2 MB whole, delta 41.0 kB (0.013x, 0.40% changed), "
        "sent 41.0 kB in 0.05s"
    )


def test_a_shared_disk_version_says_nothing_was_sent() -> None:
    assert (
        status(published(None)).splitlines()[2].endswith("3.2 MB whole, nothing sent (shared disk)")
    )


def test_a_weights_published_from_before_wire_existed_still_reads() -> None:
    from pathlib import Path

    old = Path(__file__).parents[2] / "fixtures/golden/compat/WeightsPublished-without-wire.msgpack"
    msg = decode(old.read_bytes(), WeightsPublished)
    assert msg.wire is None and "nothing sent" in status(msg)

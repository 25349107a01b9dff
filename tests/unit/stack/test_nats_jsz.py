"""Parsing `/jsz` reports (shapes as nats-server 2.15 writes them; the
cluster tests read real ones)."""

from __future__ import annotations

from services.stack.localdev import nats_jsz

META = {
    "meta_cluster": {
        "name": "flywheel",
        "leader": "nats-1",
        "replicas": [
            {"name": "nats-0", "current": True, "active": 1},
            {"name": "nats-2", "current": False, "offline": True, "active": 0},
        ],
    }
}
A = {"name": "A", "cluster": {"leader": "nats-0"}, "state": {"messages": 7}}
B = {"name": "B", "cluster": {"name": "flywheel"}, "state": {"messages": 0}}  # no leader yet
C = {"name": "C", "state": {"messages": 1}}  # not clustered
STREAMS = {
    "account_details": [
        {"name": "$G", "stream_detail": [A, B]},
        {"name": "other", "stream_detail": [C]},
    ]
}


def test_meta_leader_and_current_peers() -> None:
    assert nats_jsz.meta_leader(META) == "nats-1"
    assert nats_jsz.current_peers(META) == {"nats-0"}  # nats-2 is offline
    assert nats_jsz.meta_leader({}) is None and nats_jsz.current_peers({}) == set()
    assert nats_jsz.meta_leader({"meta_cluster": {"leader": ""}}) is None


def test_stream_leaders_and_messages_across_accounts() -> None:
    assert nats_jsz.stream_leaders(STREAMS) == {"A": "nats-0", "B": None, "C": None}
    assert nats_jsz.stream_messages(STREAMS, "A") == 7
    assert nats_jsz.stream_messages(STREAMS, "C") == 1
    assert nats_jsz.stream_messages(STREAMS, "missing") is None

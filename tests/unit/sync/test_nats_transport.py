"""Sync's registry with weights sent over NATS: an engine is due only once its copy exists."""

from __future__ import annotations

import pytest

from proto.streams import parse_weights_nats_uri, weights_nats_uri
from services.rollout.core import prunable
from services.sync.core import Published, Registry, path_for
from services.weights import LocalCopy, SharedDir


def test_engine_is_updated_only_after_its_download_with_its_own_path() -> None:
    r = Registry()
    r.heartbeat("a", "http://a", 0, now=0, weights_dir="/local/a", downloaded=None)
    r.heartbeat("b", "http://b", 0, now=0, weights_dir="/local/b/", downloaded=1)
    r.publish(Published(1, LocalCopy(1), 0))
    due = r.updates_due(now=0)
    assert [e.engine_id for e in due] == ["b"]
    assert path_for(due[0], r.latest) == "/local/b/v000001"
    assert [e.engine_id for e in r.awaiting_copy(now=0)] == ["a"]
    r.heartbeat("a", "http://a", 0, now=1, weights_dir="/local/a", downloaded=1)
    assert {e.engine_id for e in r.updates_due(now=1)} == {"a", "b"}
    assert r.awaiting_copy(now=1) == []
    # the ready minimum waits for the engine that has no copy yet
    r.succeeded(r.engines["b"], 1)
    assert r.ready_version(now=1) == 0


def test_shared_path_needs_no_download_and_no_local_dir() -> None:
    r = Registry()
    r.heartbeat("a", "http://a", 0, now=0)
    r.publish(Published(2, SharedDir("/shared/v000002"), 0))
    (e,) = r.updates_due(now=0)
    assert path_for(e, r.latest) == "/shared/v000002"


def test_engine_without_local_dir_never_gets_a_nats_version() -> None:
    r = Registry()
    r.heartbeat("a", "http://a", 0, now=0, downloaded=5)  # misconfigured worker
    r.publish(Published(1, LocalCopy(1), 0))
    assert r.updates_due(now=0) == []
    with pytest.raises(ValueError, match="no local weights directory"):
        path_for(r.engines["a"], r.latest)


def test_nats_uri_round_trip() -> None:
    uri = weights_nats_uri("run-1", 12)
    assert uri == "nats://FLYWHEEL_run-1_WEIGHTDATA/12"
    assert parse_weights_nats_uri(uri) == ("FLYWHEEL_run-1_WEIGHTDATA", 12)
    for bad in ("file:///x", "nats://S/", "nats:///3", "nats://S/x"):
        with pytest.raises(ValueError):
            parse_weights_nats_uri(bad)


@pytest.mark.parametrize(
    ("held", "serving", "keep", "gone"),
    [
        ([], 0, 2, []),
        ([1, 2, 3], 3, 2, [1]),
        ([1, 2, 3], 1, 2, []),  # never the version being served
        ([1, 2, 3, 4], 2, 1, [1]),
        ([5], 0, 2, []),
    ],
)
def test_worker_prunes_old_local_versions(held, serving, keep, gone) -> None:
    assert prunable(held, serving, keep) == gone

"""The sync registry: who needs an update, when a version is ready, failures and joins."""

from __future__ import annotations

from services.sync.core import Published, Registry
from services.weights import SharedDir


def reg() -> Registry:
    return Registry(liveness_s=10, max_failures=2, backoff_s=1, max_backoff_s=4)


def test_nothing_due_before_a_publish() -> None:
    r = reg()
    r.heartbeat("a", "http://a", 0, now=0)
    assert r.updates_due(0) == []
    assert r.to_announce(0) == 0  # every engine serves the initial version
    r.announced = 0
    assert r.to_announce(0) is None


def test_every_live_engine_is_updated_then_ready() -> None:
    r = reg()
    r.heartbeat("a", "http://a", 0, now=0)
    r.heartbeat("b", "http://b", 0, now=0)
    r.announced = 0
    assert r.publish(Published(1, SharedDir("/w/v1"), 0))
    assert not r.publish(Published(1, SharedDir("/w/v1"), 0))  # not newer
    due = r.updates_due(1)
    assert [e.engine_id for e in due] == ["a", "b"]
    for e in due:
        r.started(e)
    assert r.updates_due(1) == []  # in progress: not started twice
    r.succeeded(due[0], 1)
    assert r.to_announce(1) is None  # b still serves 0
    r.succeeded(due[1], 1)
    assert r.to_announce(1) == 1


def test_a_failing_engine_backs_off_then_stops_holding_up_ready() -> None:
    r = reg()
    r.heartbeat("a", "http://a", 0, now=0)
    r.heartbeat("bad", "http://bad", 0, now=0)
    r.announced = 0
    r.publish(Published(1, SharedDir("/w/v1"), 0))
    a, bad = r.updates_due(0)
    r.succeeded(a, 1)
    r.failed(bad, now=0)
    assert r.updates_due(0.5) == []  # backing off for 1 s
    assert r.to_announce(0.5) is None  # one failure: still waited for
    assert [e.engine_id for e in r.updates_due(1.0)] == ["bad"]
    r.failed(bad, now=1.0)  # second failure: retry in 2 s, no longer waited for
    assert bad.retry_at == 3.0
    assert r.to_announce(1.5) == 1
    r.succeeded(bad, 1)
    assert bad.failures == 0


def test_new_engine_is_brought_to_the_latest_version() -> None:
    r = reg()
    r.heartbeat("a", "http://a", 3, now=0)
    r.publish(Published(3, SharedDir("/w/v3"), 0))
    r.announced = 3
    r.heartbeat("new", "http://new", 0, now=1)
    assert [e.engine_id for e in r.updates_due(1)] == ["new"]
    assert r.to_announce(1) is None  # v3 already announced; the newcomer lowers the minimum


def test_dead_engines_are_forgotten_and_a_restart_is_believed() -> None:
    r = reg()
    r.heartbeat("a", "http://a", 2, now=0)
    r.heartbeat("b", "http://b", 2, now=0)
    r.heartbeat("a", "http://a", 2, now=15)
    assert r.forget_dead(15) == ["b"]
    r.heartbeat("a", "http://a", 0, now=16)  # restarted: serves the initial weights again
    assert r.engines["a"].version == 0


def test_an_engine_on_a_version_wanted_for_evaluation_is_held_there_until_it_ran() -> None:
    """The tie of a figure to its version: the engine that reaches a wanted version does not
    move on before that version's evaluation ended; the others go on once it started."""
    r = reg()
    r.heartbeat("a", "http://a", 0, now=0)
    r.heartbeat("b", "http://b", 0, now=0)
    r.wanted[1] = 0.0  # asked for before v1 is published (the trainer's order)
    r.publish(Published(1, SharedDir("/w/v1"), 0))
    assert r.evals_due(0) == ([], None)  # no engine serves v1 yet: wait, do not skip
    a, b = r.updates_due(0)
    r.succeeded(a, 1)
    r.succeeded(b, 1)
    r.publish(Published(2, SharedDir("/w/v2"), 0))
    assert r.updates_due(0) == []  # both on v1, held: no evaluation has started
    skipped, (version, engine) = r.evals_due(0)  # type: ignore[misc]
    assert (skipped, version, engine.engine_id) == ([], 1, "a")
    assert r.evals_due(0) == ([], None)  # one at a time
    assert [e.engine_id for e in r.updates_due(0)] == ["b"]  # b goes on, a stays
    r.evaluated(1)
    assert [e.engine_id for e in r.updates_due(0)] == ["a", "b"]


def test_a_wanted_version_no_engine_will_serve_is_given_up() -> None:
    """Engines update to the newest version, never to one between: a wanted version no engine
    serves while a newer one is published will never be served, so it is skipped (and said),
    not waited for."""
    r = reg()
    r.heartbeat("a", "http://a", 3, now=0)
    r.publish(Published(3, SharedDir("/w/v3"), 0))
    r.wanted[2] = 0.0  # asked for after the engine went past it
    r.wanted[3] = 0.0
    skipped, start = r.evals_due(0)
    assert skipped == [2] and start is not None and start[0] == 3
    assert 2 not in r.wanted

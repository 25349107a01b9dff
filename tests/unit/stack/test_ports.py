"""free_port: below the ephemeral range, and per-worker slices for parallel tests."""

from __future__ import annotations

import socket

import pytest

from services.stack.localdev import ports


@pytest.fixture(autouse=True)
def _keep_this_workers_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_next", ports._next)  # restored after each test


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    top = ports._ephemeral_start()
    for _ in range(5):
        port = ports.free_port()
        assert ports.LOWEST <= port < top
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free now: OSError would fail the test


def test_each_worker_slice_starts_where_it_was_told() -> None:
    top = ports._ephemeral_start()
    width = top - ports.LOWEST
    firsts = []
    for worker in range(4):
        ports.start_at(worker / 4)
        firsts.append(ports.free_port())
    for worker, port in enumerate(firsts):
        # the first free port at or above the slice's start (a few may be taken)
        assert ports.LOWEST + worker * width // 4 <= port < ports.LOWEST + (worker + 1) * width // 4
    ports.start_at(0.999)  # clamped inside the range; the search wraps to LOWEST at the top
    assert ports.LOWEST <= ports.free_port() < top

"""Shared fixtures: a real nats-server per test (or per module), like nats.py's own tests.

Tests stay plain pytest: an async test body runs under `asyncio.run(...)`
(`run_async`, tests/harness/poll.py), so no event-loop plugin is needed and
every test gets a fresh loop. Connections opened inside a test body must be
closed inside it.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.runtime.settings import NatsSettings
from services.stack.localdev import ports
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import eventually, run_async


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`), each worker hands out ports from its own slice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        ports.start_at(int(worker.removeprefix("gw")) / count)


# The longest modules under `make test` (minutes each on 2 cores), longest first.
LONGEST_FIRST = (
    "tests/e2e/test_demo_learns.py",
    "tests/chaos/test_chaos.py",
    "tests/loop/test_eval_beside.py",
    "tests/integration/trainer/test_sft.py",
    "tests/integration/trainer/test_entropy_control.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Whole modules in the order: LONGEST_FIRST, the other modules with a slow test, the rest.

    `make test` hands modules to its xdist workers in this order (`--dist loadscope
    --no-loadscope-reorder`). xdist's own order, most tests first, dealt the heavy
    modules of one or two tests out last, so the longest (the demo, ~5 min) started
    when the rest were nearly done and the run waited on it alone. Longest first, the
    many short unit tests fill the workers at the end. A module keeps its tests
    together and in order (its module fixtures start once).
    """
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module in LONGEST_FIRST:
            r = LONGEST_FIRST.index(module)
        else:
            r = len(LONGEST_FIRST) + (0 if item.get_closest_marker("slow") else 1)
        rank[module] = min(r, rank.get(module, r))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream: free port, temporary store."""
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module")
def nats_server_module() -> Iterator[NatsServer]:
    """One nats-server shared by a module's tests (use distinct run names per test)."""
    with NatsServer() as server:
        yield server


@pytest.fixture
def nats_settings(nats_server: NatsServer) -> NatsSettings:
    """NatsSettings pointing at the per-test server (few attempts: it is already up)."""
    return NatsSettings(url=nats_server.url, connect_attempts=3)


@pytest.fixture
def nats_settings_module(nats_server_module: NatsServer) -> NatsSettings:
    return NatsSettings(url=nats_server_module.url, connect_attempts=3)


@pytest.fixture(name="run_async")
def run_async_fixture() -> Callable[..., Any]:
    """`run_async` as a fixture, for test modules that do not import conftest."""
    return run_async


@pytest.fixture(name="eventually")
def eventually_fixture() -> Callable[..., Awaitable[None]]:
    return eventually


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (services/models/tiny_model.py), written once per session.
    Shared: tests and the processes they start read it, never write into it."""
    from services.models.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", TinyModelSpec())

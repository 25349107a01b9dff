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
    # Held-out evaluations at the training's own CPU priority in every stack a test starts:
    # at the default nice 19 an evaluation on cores xdist keeps full gets ~1.5% of one and
    # a test waiting for its row times out. tests/unit/runtime/test_threads.py and
    # tests/integration/trainer/test_heldout_priority.py test the default itself.
    os.environ.setdefault("FLYWHEEL_TRAINER_EVAL_NICE", "0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `slow` modules first: longest work first, so the suite does not end on them.

    With `--dist loadscope`, xdist hands modules out in collection order (the
    Makefile turns off its reordering by test count, which put the many-case
    modules first and the few-test stacks, the longest, at the end: one worker
    still running a stack while the others had finished). A stable sort: the
    order within each group stays the collection's.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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

"""Shared fixtures: a real nats-server per test (or per module), like nats.py's own tests.

Tests stay plain pytest: an async test body runs under `asyncio.run(...)`
(see `run_async`), so no event-loop plugin is needed and every test gets a
fresh loop. Connections opened inside a test body must be closed inside it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from services.common.nats_server import NatsServer
from services.common.settings import NatsSettings

T = TypeVar("T")


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


def run_async(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """Run an async test body in a fresh event loop, with an overall deadline."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


async def eventually(
    check: Callable[[], Awaitable[object] | object],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
) -> None:
    """Poll `check` until it is true; fail the test at the deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s: {check}")
        await asyncio.sleep(interval_s)


@pytest.fixture(name="run_async")
def run_async_fixture() -> Callable[..., Any]:
    """`run_async` as a fixture, for test modules that do not import conftest."""
    return run_async


@pytest.fixture(name="eventually")
def eventually_fixture() -> Callable[..., Awaitable[None]]:
    return eventually

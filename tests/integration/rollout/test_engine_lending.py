"""A rollout worker's side of the core lease against a real CPU engine: while its tasks are
in flight the engine computes with what the lease gives (every core while the trainer
waits, its share while the trainer trains); without tasks it counts as idle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.engine.app import build_app
from services.engine_api.engine_client import EngineClient
from services.rollout.lending import EngineLending
from services.rollout.metrics import RolloutMetrics
from services.runtime.cores import CoreLease, CoreLeaseSettings
from tests.harness.engines import EngineStates, serving


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[EngineStates]:
    e = EngineStates(tiny_model)
    yield e
    e.close()


def test_the_engine_gets_the_trainers_core_while_the_trainer_waits(
    engines: EngineStates, tmp_path: Path, run_async: Any
) -> None:
    state = engines.get()
    s = CoreLeaseSettings(dir=tmp_path / "cores", total=2, poll_s=0.05)
    trainer = CoreLease(s, "trainer")

    async def until(cond: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while not await cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def body() -> None:
        async with serving(build_app(state)) as url, EngineClient(url, retries=0) as c:
            registry = CollectorRegistry()
            metrics = RolloutMetrics(registry)
            lending = EngineLending(s, "engine-0", c, metrics)
            assert lending.lease is not None
            lending.lease.runnable = lambda: 1  # a quiet machine (the shared one here is not)
            stop = asyncio.Event()
            loop = asyncio.create_task(lending.run(stop))
            await c.set_num_threads(1)
            lending.started()  # a task in flight; the trainer waits for its batch
            await until(lambda: _threads(c, 2), "the engine never got the trainer's core")
            trainer.mark(True)  # a batch arrived
            await until(lambda: _threads(c, 1), "the engine never gave the core back")
            lending.finished()
            assert (tmp_path / "cores" / "engine-0").read_text().split()[1] == "idle"
            idle = registry.get_sample_value("flywheel_rollout_engine_idle_fraction")
            assert idle is not None and 0.0 < idle < 1.0  # busy for a while, idle before
            stop.set()
            await loop
        assert not (tmp_path / "cores" / "engine-0").exists()  # left the lease

    run_async(body(), timeout_s=60)


async def _threads(c: EngineClient, n: int) -> bool:
    return await c.num_threads() == n

"""The CPU engine's colocation routes against real engines (services/engine/memory_api.py).

What SGLang's scheduler refuses by dying, the CPU engine refuses the same way:
a release while a request runs (0.5.5+) and a resume of a tag never released
close the caller's connection and stop the server (`on_crash`). The
thread-count hook changes the threads the model computes with, on the
scheduler thread, and generation goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from services.engine.app import build_app
from services.engine_api.engine_client import EngineClient, EngineError, EngineHTTPError
from services.engine_api.sglang_api import RELEASE_ASSERT
from tests.harness.engines import EngineStates, serving


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[EngineStates]:
    e = EngineStates(tiny_model)
    yield e
    e.close()


@asynccontextmanager
async def client_of(state: Any) -> AsyncIterator[EngineClient]:
    async with serving(build_app(state)) as url, EngineClient(url, retries=0) as c:
        yield c


async def running(c: EngineClient, n: int = 1) -> None:
    while (await c.loads()).running < n:
        await asyncio.sleep(0.02)


def test_a_release_while_generating_kills_the_engine_as_sglangs_scheduler_dies(
    engines: EngineStates, run_async: Any
) -> None:
    state = engines.get(sglang_version="0.5.23", random_seed=101)  # its own: it dies
    crashed: list[str] = []
    state.on_crash = crashed.append

    async def body() -> None:
        async with client_of(state) as c:
            await c.request("POST", "/slow_down", {"forward_sleep_time": 0.05})
            flight = asyncio.create_task(
                c.generate([4, 5], sampling_params={"max_new_tokens": 200, "ignore_eos": True})
            )
            await running(c)
            with pytest.raises(EngineError) as e:
                await c.release_memory_occupation(["weights"])
            assert not isinstance(e.value, EngineHTTPError)  # no answer at all
            with pytest.raises(EngineError):
                await flight  # the dying process takes open generations with it

    run_async(body(), timeout_s=60)
    assert crashed == [f"the engine scheduler crashed: AssertionError: {RELEASE_ASSERT}"]
    assert state.released == set()


def test_resuming_a_tag_never_released_kills_the_engine(
    engines: EngineStates, run_async: Any
) -> None:
    state = engines.get(sglang_version="0.5.23", random_seed=102)
    crashed: list[str] = []
    state.on_crash = crashed.append

    async def body() -> None:
        async with client_of(state) as c:
            await c.release_memory_occupation(["kv_cache"])
            with pytest.raises(EngineError):
                await c.resume_memory_occupation(["kv_cache", "weights"])

    run_async(body(), timeout_s=60)
    assert crashed == ["the engine scheduler crashed: KeyError: 'weights'"]


def test_release_and_resume_around_a_pause_and_generation_after(
    engines: EngineStates, run_async: Any
) -> None:
    """The colocated step's sequence: pause, release, (train), resume, continue."""
    state = engines.get(sglang_version="0.5.23")
    crashed: list[str] = []
    state.on_crash = crashed.append

    async def body() -> None:
        async with client_of(state) as c:
            await c.generate([4, 5, 6, 7], sampling_params={"max_new_tokens": 1})
            assert state.scheduler.prefix_cache_entries().result() > 0
            await c.pause_generation("abort")
            await c.release_memory_occupation()
            assert state.released == {"kv_cache", "weights", "cuda_graph"}
            # SGLang flushes its radix cache with the KV pool it releases
            assert state.scheduler.prefix_cache_entries().result() == 0
            await c.resume_memory_occupation()
            await c.continue_generation()
            out = await c.generate([4, 5], sampling_params={"max_new_tokens": 3})
            assert len(out[0].output_ids) == 3

    run_async(body(), timeout_s=60)
    assert crashed == [] and state.released == set()


def test_the_thread_hook_sets_the_schedulers_threads_and_generation_goes_on(
    engines: EngineStates, run_async: Any
) -> None:
    state = engines.get(sglang_version="0.5.23")

    async def body() -> None:
        async with client_of(state) as c:
            before = await c.num_threads()
            assert await c.set_num_threads(1) == before
            assert await c.num_threads() == 1
            out = await c.generate([4, 5], sampling_params={"max_new_tokens": 2})
            assert len(out[0].output_ids) == 2
            assert await c.set_num_threads(2) == 1
            assert await c.num_threads() == 2
            with pytest.raises(EngineHTTPError) as e:
                await c.set_num_threads(0)
            assert e.value.status == 400

    run_async(body(), timeout_s=60)

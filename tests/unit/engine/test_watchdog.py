"""The engine exits with its scheduler thread, however it ended (probes.watch_scheduler)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from services.engine.probes import watch_scheduler
from services.engine.scheduler import answer


class Thread:
    """What watch_scheduler reads of a Scheduler: a thread that may end."""

    def __init__(self, crashed: str | None) -> None:
        self.crashed = crashed
        self.done = threading.Event()
        self.t = threading.Thread(target=self.done.wait, daemon=True)
        self.t.start()

    def alive(self) -> bool:
        return self.t.is_alive()


def test_a_dead_scheduler_stops_the_server_with_its_reason() -> None:
    async def body() -> list[str]:
        stop, why = asyncio.Event(), []
        sched = Thread(crashed=None)
        task = asyncio.create_task(watch_scheduler(sched, why.append, stop))  # type: ignore[arg-type]
        await asyncio.sleep(0.7)
        assert why == []  # alive: nothing to say
        sched.done.set()
        await asyncio.wait_for(task, 5)
        return why

    assert asyncio.run(body()) == ["the engine scheduler stopped"]


def test_answering_a_caller_who_went_is_not_an_error() -> None:
    gone: Future[int] = Future()
    gone.cancel()  # the HTTP client hung up
    answer(gone, 1)  # does not raise
    answer(gone, error=RuntimeError("x"))
    here: Future[int] = Future()
    answer(here, 2)
    assert here.result() == 2

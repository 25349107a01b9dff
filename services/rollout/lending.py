"""The engine's side of the core lease (services/runtime/cores.py), kept by its worker.

The worker knows when its engine has work: while any of its tasks is in
flight. That is the engine's busy state on the lease, and the engine idle
fraction the worker reports (`flywheel_rollout_engine_idle_fraction`, lease
or not). With a lease (`[rollout.cores]`, set by `flywheel up`'s colocated
placement), the worker reads the lease every `poll_s` while tasks are in
flight and gives its engine the count through the CPU engine's thread hook
(`/flywheel/num_threads`, its own HTTP API, as every other call of the
worker's is): every core while the trainer waits for a batch, the engine's
share while it trains. An engine without the hook (SGLang: 404) is told
once in the log and not asked again; the worker still marks its phases.
"""

from __future__ import annotations

import asyncio
import logging

from services.engine_api.engine_client import EngineClient, EngineError, EngineHTTPError
from services.rollout.metrics import RolloutMetrics
from services.runtime.cores import BusyClock, CoreLease, CoreLeaseSettings

log = logging.getLogger(__name__)


class EngineLending:
    """In-flight tasks as the engine's busy state; the lease's thread count to the engine."""

    def __init__(
        self,
        settings: CoreLeaseSettings,
        role: str,
        client: EngineClient,
        metrics: RolloutMetrics,
    ) -> None:
        self.settings = settings
        self.client = client
        self.metrics = metrics
        self.clock = BusyClock()
        self.lease = CoreLease(settings, role) if settings.enabled else None
        self.in_flight = 0
        self.given: int | None = None  # the count the engine was last given
        self.hookless = False  # the engine has no thread hook (SGLang)
        metrics.engine_idle.set_function(self.clock.idle_fraction)

    def started(self) -> None:
        self.in_flight += 1
        if self.in_flight == 1:
            self.clock.busy()
            if self.lease is not None:
                self.lease.mark(True)

    def finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.clock.idle()
            if self.lease is not None:
                self.lease.mark(False)

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: the lease's count to the engine while it has work."""
        if self.lease is None:
            return
        try:
            while not stop.is_set() and not self.hookless:
                if self.in_flight:
                    await self.give(self.lease.threads(mine=self.given or self.settings.share))
                try:
                    await asyncio.wait_for(stop.wait(), self.settings.poll_s)
                except TimeoutError:
                    pass
        finally:
            self.lease.close()

    async def give(self, n: int) -> None:
        """Set the engine's threads to `n` if it has another count."""
        if n == self.given:
            return
        try:
            await self.client.set_num_threads(n)
        except EngineHTTPError as e:
            if e.status == 404:
                log.info("rollout: the engine has no thread hook (%s): cores not lent", e)
                self.hookless = True
                return
            log.warning("rollout: the engine refused %d threads: %s", n, e)
            return
        except EngineError as e:  # restarting: try again at the next poll
            log.debug("rollout: engine unreachable for its thread count: %s", e)
            return
        self.given = n
        self.metrics.engine_threads.set(n)

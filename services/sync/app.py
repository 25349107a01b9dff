"""The weight-sync service: brings every live engine to the newest weights.

Inputs: engine heartbeats (core subscription on `engines.*`; the registry
is rebuilt within one heartbeat interval after a restart) and
`WeightsPublished` (durable consumer). A reconcile loop asks the pure
registry what is due — updates to start, a version to announce — and does
it, at once when something happened (a version published, an update
finished, a heartbeat) and at least every `tick_s` (liveness). Waking on
events rather than only on the tick matters: each version passes through
the loop twice (start the updates, then announce), and with a 0.2 s tick
that alone added ~0.2 s to every publish→ready, a third of a demo step.
Each engine update runs as its own task (pause → update_weights_from_disk →
continue, or just update and let running requests finish), so a slow or
dead engine never holds up the others.

The update asks each engine's SGLang release first (once per engine URL):
an `update_mode` the release cannot do (retract or in_place before 0.5.6,
where /pause_generation always aborts) is a configuration error: sync
stops with the release named, before anything is paused, since no update
of that engine could ever succeed. The `flush_cache` sent is the one that
release survives (in_place never flushes: a flush with requests held
answers 400 from 0.5.22 and killed the scheduler before).

Sync also runs the held-out evaluations the trainer asks for on the engines
(`EvalRequest`, evaluating.py): each reconcile first lets them hold an engine
on the version they measure, then starts the updates that are still due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from proto.codec import decode
from proto.errors import ProtocolError
from proto.messages import EngineHeartbeat, EvalRequest, WeightsPublished, WeightsReady
from proto.streams import consumers_for, stream_name
from proto.subjects import Subjects
from services.engine_api.engine_client import EngineClient, EngineError
from services.engine_api.sglang_api import Capabilities, UnsupportedEngine
from services.runtime.errors import ConfigError
from services.runtime.lifecycle import ServiceContext
from services.runtime.missing import not_found_missing
from services.runtime.msgloop import Delivery, pause
from services.runtime.nats_conn import ensure_consumer
from services.runtime.publish import publish
from services.sync.core import Engine, Published, Registry, path_for
from services.sync.evaluating import EngineEvaluations
from services.sync.metrics import SyncMetrics
from services.sync.settings import SyncSettings
from services.weights import Transports, Wiring
from services.weights.adapter_load import (
    AdapterLoad,
    MergedLoad,
    loaded_adapters,
    unload_superseded,
)

log = logging.getLogger(__name__)


class SyncService:
    def __init__(self, ctx: ServiceContext, s: SyncSettings) -> None:
        self.ctx = ctx
        self.s = s
        self.subjects = Subjects(s.run)
        self.reg = Registry(
            liveness_s=s.liveness_s, max_failures=s.max_failures, backoff_s=s.retry_backoff_s
        )
        self.metrics = SyncMetrics(ctx.registry)
        self.sizes: dict[int, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        # the transports that announced URIs name (and the version directories to prune)
        self.weights = Transports(
            Wiring(
                s.run,
                s.weights_root,
                ctx.js,
                max_payload=ctx.max_payload,
                dist_address=s.distributed_address,
            )
        )
        self.releases: dict[str, Capabilities] = {}  # engine URL -> its SGLang release
        self.resumed: set[str] = set()  # engine URLs this process told to continue
        self.fatal: ConfigError | None = None  # an engine no update can succeed on: stop
        self.wake = asyncio.Event()  # something happened: reconcile now, not at the next tick
        # held-out evaluations the trainer asks of the engines (evaluating.py)
        self.evals = EngineEvaluations(ctx, s, self.reg, self.wake)

    async def restore(self) -> None:
        """The newest published and announced versions, from the WEIGHTS stream."""
        from nats.js.errors import NotFoundError

        stream = stream_name(self.s.run, "WEIGHTS")
        for subject, cls in (
            (self.subjects.weights_published, WeightsPublished),
            (self.subjects.weights_ready, WeightsReady),
        ):
            try:
                raw = await self.ctx.js.get_last_msg(stream, subject)
            except NotFoundError as e:  # nothing there yet; or no stream (then: stop)
                missing = not_found_missing(e, stream, f"reading the last {cls.__name__}")
                if missing is not None:
                    raise missing from e
                continue
            try:
                msg = decode(raw.data or b"", cls)
            except ProtocolError as e:
                log.warning("sync: ignoring unreadable last message on %s: %s", subject, e)
                continue
            if isinstance(msg, WeightsPublished):
                await self.on_published(msg, None)
            elif isinstance(msg, WeightsReady):
                self.reg.announced = msg.version
        latest = self.reg.latest.version if self.reg.latest else None
        log.info("sync: resumed with published=%s announced=%d", latest, self.reg.announced)

    def on_heartbeat(self, hb: EngineHeartbeat) -> None:
        self.reg.heartbeat(
            hb.engine_id,
            hb.url,
            hb.weight_version,
            time.time(),
            weights_dir=hb.local_weights_dir,
            downloaded=hb.downloaded_version,
        )
        self.wake.set()

    async def on_published(self, msg: WeightsPublished, _d: Delivery | None) -> None:
        source = self.weights.for_uri(msg.uri).source(msg.uri, msg.version)
        adapter = msg.format == "peft-lora" and self.s.lora_mode == "adapter"
        if msg.format == "peft-lora":
            source = AdapterLoad(source) if adapter else MergedLoad(source)
        p = Published(msg.version, source, msg.published_at or time.time(), adapter=adapter)
        if self.reg.publish(p):
            self.sizes[msg.version] = msg.size_bytes
            self.metrics.published.set(msg.version)
            log.info("sync: version %d published at %s", msg.version, msg.uri)
            self.wake.set()

    async def update(self, e: Engine, p: Published) -> None:
        try:
            await self._update(e, p)
        finally:
            self.wake.set()  # the version may now be ready everywhere

    async def _update(self, e: Engine, p: Published) -> None:
        started = time.monotonic()
        # An adapter loads beside the ones serving: nothing to pause.
        mode = "wait" if p.adapter else self.s.update_mode
        key = self.s.engine_api_key.get_secret_value() if self.s.engine_api_key else None
        try:
            client = EngineClient(
                e.url,
                timeout_s=self.s.update_timeout_s,
                retries=2,
                api_key=key,
                capabilities=self.releases.get(e.url),
            )
            async with client as c:
                release = self.releases[e.url] = await c.capabilities()
                release.check_update_mode(mode)
                if mode != "wait":
                    await c.pause_generation(mode)
                try:
                    res = await p.source.load(c, path_for(e, p), p.version, mode)
                finally:
                    if mode != "wait":
                        await c.continue_generation()
                if p.adapter and res.success:
                    await self._adapter_loaded(c, e, p)
            if not res.success:
                raise EngineError(res.message, e.url)
        except UnsupportedEngine as err:
            self.reg.failed(e, time.time())
            self.metrics.failures.labels(engine=e.engine_id).inc()
            self.fatal = ConfigError(
                f"[sync] update_mode = {mode!r}: engine {e.engine_id} at {e.url}: {err}"
            )
            log.error("sync: %s", self.fatal)
            return
        except (EngineError, TimeoutError) as err:
            self.releases.pop(e.url, None)  # it may have restarted as another release
            self.reg.failed(e, time.time())
            self.metrics.failures.labels(engine=e.engine_id).inc()
            log.warning(
                "sync: engine %s failed to load v%d (failure %d): %s",
                e.engine_id,
                p.version,
                e.failures,
                err,
            )
            return
        self.reg.succeeded(e, p.version)
        self.metrics.update_seconds.observe(time.monotonic() - started)
        self.metrics.engine_version.labels(engine=e.engine_id).set(p.version)
        self.metrics.bytes.inc(self.sizes.get(p.version, 0))
        log.info("sync: engine %s serves v%d", e.engine_id, p.version)

    async def _adapter_loaded(self, c: EngineClient, e: Engine, p: Published) -> None:
        """Count `p` served on `e` at once (the worker sends the newest adapter's name from
        its next task on), then unload the superseded adapters, which waits for the
        requests still using them; a failed unload is retried after the next version."""
        e.adapters.add(p.version)
        self.reg.succeeded(e, p.version)
        e.updating = True  # still ours (heartbeats must not move it) until the unloads end
        self.wake.set()  # the version may be ready everywhere now
        try:
            if not e.adapters_read:  # a restarted sync: what an earlier one left loaded
                e.adapters |= await loaded_adapters(c)
                e.adapters_read = True
            e.adapters = await unload_superseded(c, e.adapters, p.version, self.s.lora_keep)
        except (EngineError, TimeoutError) as err:
            log.warning("sync: engine %s: superseded adapters not unloaded: %s", e.engine_id, err)

    async def resume(self, e: Engine) -> None:
        """Continue generation on an engine met for the first time (idempotent).

        A sync that died between pause and continue leaves its engines paused;
        the engine may already serve the new version, so no update would ever
        continue it. Held as an update (`started`) so none runs meanwhile.
        """
        key = self.s.engine_api_key.get_secret_value() if self.s.engine_api_key else None
        try:
            async with EngineClient(e.url, retries=0, api_key=key, timeout_s=30) as c:
                await c.continue_generation()
        except EngineError as err:
            self.resumed.discard(e.url)  # try again at a later reconcile
            log.info("sync: engine %s not resumed yet: %s", e.engine_id, err)
        finally:
            e.updating = False
            self.wake.set()

    def _track(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def reconcile(self) -> None:
        now = time.time()
        for gone in self.reg.forget_dead(now):
            log.warning("sync: engine %s stopped sending heartbeats; dropped", gone)
            with contextlib.suppress(KeyError):  # never labelled if it never loaded a version
                self.metrics.engine_version.remove(gone)
        for e in self.reg.live(now):
            if e.url not in self.resumed and not e.updating:
                self.resumed.add(e.url)
                self.reg.started(e)
                self._track(self.resume(e))
        self.metrics.engines.set(len(self.reg.live(now)))
        self.metrics.awaiting.set(len(self.reg.awaiting_copy(now)))
        await self.evals.reconcile(now)  # first: an engine that reached a wanted version stays
        if self.reg.latest is not None:
            for e in self.reg.updates_due(now):
                self.reg.started(e)
                self._track(self.update(e, self.reg.latest))
        v = self.reg.to_announce(now)
        if v is not None:
            engines = tuple(sorted(e.engine_id for e in self.reg.healthy(now)))
            ready = WeightsReady(run=self.s.run, version=v, engines=engines, ready_at=time.time())
            await publish(self.ctx.js, self.subjects.weights_ready, ready, self.ctx.max_payload)
            self.reg.announced = v
            self.metrics.ready.set(v)
            if self.reg.latest is not None and self.reg.latest.version == v:
                self.metrics.latency.observe(max(0.0, time.time() - self.reg.latest.published_at))
            log.info("sync: v%d ready on %s", v, ", ".join(engines))
            await self.cleanup(v)

    async def cleanup(self, ready: int) -> None:
        """Drop the versions below the newest `keep_last`, never one still served."""
        served = min((e.version for e in self.reg.engines.values()), default=ready)
        floor = min(ready - self.s.keep_last + 1, served)
        await self.weights.cleanup(floor)

    async def reconcile_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.wake.clear()
            if self.fatal is not None:
                raise self.fatal
            await self.reconcile()
            await pause(stop, self.s.tick_s, self.wake)
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self.s.update_timeout_s)
        await self.evals.close()


async def body(ctx: ServiceContext) -> None:
    settings = ctx.settings
    assert isinstance(settings, SyncSettings)
    svc = SyncService(ctx, settings)
    consumer = consumers_for(settings.run)["sync"]
    await ensure_consumer(ctx.js, consumer)
    await svc.restore()

    async def on_heartbeat_msg(msg) -> None:  # core NATS callback
        try:
            svc.on_heartbeat(decode(msg.data, EngineHeartbeat))
        except ProtocolError as e:
            log.warning("sync: bad heartbeat on %s: %s", msg.subject, e)

    sub = await ctx.nc.subscribe(svc.subjects.heartbeats_all, cb=on_heartbeat_msg)
    loop = ctx.message_loop(consumer, WeightsPublished, svc.on_published)
    evals = consumers_for(settings.run)["sync-evals"]
    await ensure_consumer(ctx.js, evals)
    eval_loop = ctx.message_loop(evals, EvalRequest, svc.evals.on_request)
    ctx.readiness.ok("sync")
    tasks = [
        asyncio.create_task(loop.run(ctx.stop)),
        asyncio.create_task(eval_loop.run(ctx.stop)),
        asyncio.create_task(svc.reconcile_loop(ctx.stop)),
    ]
    try:
        # Either one failing (sync.fatal) stops both, so the connection drains at once.
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        ctx.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sub.unsubscribe()
    for t in done:
        t.result()

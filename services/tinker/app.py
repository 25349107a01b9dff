"""The HTTP adapter: the Tinker SDK's `/api/v1` routes on aiohttp, in front of one model.

The SDK's protocol is futures: a training or sampling POST answers at once with a
`request_id`, and the client polls `/api/v1/retrieve_future` until the result is
there (`{"type": "try_again"}` until then; this server holds each poll up to
`LONG_POLL_S` so a result is seen as soon as it exists). Work runs on one model
thread in the order it arrived, so a training client's forward_backward,
optim_step and save come out in its own order, and one client's request never
interleaves with another's on the shared base model.

Every request is checked (core.py) before it is queued: a bad one fails its own
future with a `user` error that names what is wrong, and nothing of the model or
any optimizer moves. A retried POST (same owner and seq_id) is answered with the
first one's request id from the request log, never run twice.

With `[tinker] engines`, a sampler's save and its samples go to the engines
(engines.py) and run on the event loop beside the model thread (`submit_async`), so
training never waits behind sampling.

Without `[tinker] journal_stream` the request log lives in this process and a
restart loses it (and the adapters). With it, every accepted request is appended to
that JetStream stream before its future id is answered, under one lock so the log's
order is the model thread's, and every answer after it; a start replays the stream
first (journal.py says how, rebuild.py does it), then listens. Every `[tinker]
journal_checkpoint_every` optim_steps the service writes a replay checkpoint
(checkpoint.py) and purges the records it makes unneeded, so a start replays only what
came after the newest one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from services.tinker import wire
from services.tinker.batching import Batch, SampleBatches
from services.tinker.checkpoint import (
    EXPIRED,
    Captured,
    CheckpointStore,
    copy_models,
    restore_models,
)
from services.tinker.core import (
    Category,
    Entry,
    Limits,
    Registry,
    RequestLog,
    SampleSpec,
    SamplingSession,
    State,
    TinkerUserError,
    TrainingModel,
    UnknownName,
    UnsupportedRoute,
    adapter_seed,
    check_batch,
    check_rank,
    check_sample,
    loss_config,
)
from services.tinker.engines import EnginePool, EngineSampling
from services.tinker.journal import (
    Checkpoint,
    Intake,
    Journal,
    JournalCorrupt,
    JournalUnavailable,
    Outcome,
    Replay,
)
from services.tinker.model import AdapterModel
from services.tinker.routing import future_response as _future
from services.tinker.routing import read_body as _body
from services.tinker.routing import run_if_fresh as _submitted
from services.tinker.settings import TinkerSettings
from services.tinker.state import StateStore
from services.tinker.state_routes import STATE_ROUTES

log = logging.getLogger("flywheel.tinker")

LONG_POLL_S = (
    10.0  # a retrieve_future waits this long for a pending result (the SDK's own timeout is 45 s)
)
PROTOBUF = "application/x-protobuf"


class Service:
    """What the handlers share: the model and its thread, the registry and the request log."""

    def __init__(self, settings: TinkerSettings, model: AdapterModel, model_dir: Path) -> None:
        self.settings = settings
        self.model = model
        self.model_dir = model_dir
        self.base_name = settings.model_name or model_dir.name
        self.limits = Limits(
            max_datums=settings.max_datums,
            max_tokens=settings.max_tokens,
            vocab_size=model.vocab_size,
            max_num_samples=settings.max_num_samples,
            max_sample_tokens=settings.max_sample_tokens,
            max_rank=settings.max_rank,
        )
        self.log = RequestLog()
        self.registry = Registry()
        self.store = StateStore(Path(settings.state_dir))
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="tinker-model")
        self.batches: SampleBatches[Entry] = SampleBatches(settings.max_num_samples)
        self._finished: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # With [tinker] engines: samplers are adapters on the engines (engines.py).
        self.engines: EngineSampling | None = None
        if settings.engines:
            pool = EnginePool(settings.engines, settings.engine_timeout_s)
            root = Path(settings.state_dir) / ".samplers"
            self.engines = EngineSampling(pool, root, uuid.uuid4().hex[:8], settings.lora_alpha)
        self.journal: Journal | None = None  # [tinker] journal_stream's, opened by serve()
        self.replay: Replay | None = None  # while a start replays the journal
        # Held from a journaled request's log entry to its queueing on the model thread,
        # so the journal's order is the order the model runs them in.
        self.intake = asyncio.Lock()
        # The journal's replay checkpoints (journal.py): where they go, the newest one
        # (loaded or written), optim_steps since it, and the request ids whose answers
        # the next one drops (those the last one held: kept one interval).
        self.checkpoints: CheckpointStore | None = None
        if settings.journal_stream:
            root = Path(settings.checkpoint_dir) / settings.journal_stream
            self.checkpoints = CheckpointStore(root)
        self.last_checkpoint: Checkpoint | None = None
        self.steps_since_checkpoint = 0
        self._checkpointing: asyncio.Task[Checkpoint | None] | None = None
        self._answers_to_expire: set[str] = set()

    def check_base(self, name: str | None) -> None:
        if name not in (self.base_name, str(self.model_dir)):
            raise UnknownName(f"base_model {name!r} is not served here; this server serves "
                              f"{self.base_name!r}")  # fmt: skip

    def submit(
        self,
        entry: Entry,
        work: Callable[[], Any],
        then: Callable[[Any], Any] = lambda r: r,
    ) -> None:
        """Run `work` on the model thread (queued now, so in arrival order); its result,
        through `then` on the event loop, completes the entry."""

        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                return work()
            finally:
                log.debug("%s %s: %.3f s", entry.kind, entry.request_id, time.perf_counter() - t0)

        queued = asyncio.get_running_loop().run_in_executor(self.thread, timed)

        async def result() -> Any:
            return then(await queued)

        self.submit_async(entry, result())

    def submit_async(self, entry: Entry, run: Coroutine[Any, Any, Any]) -> None:
        """Complete `entry` with what `run` returns, on the event loop (work on the engines
        runs beside the model thread, not in its queue; `submit` awaits its turn there)."""
        done = self._finished.setdefault(entry.request_id, asyncio.Event())

        async def finish() -> None:
            try:
                outcome = Outcome(entry.request_id, False, await run)
            except TinkerUserError as e:
                outcome = _failed(entry, str(e), Category.USER)
            except Exception as e:  # a server fault: that request fails, loudly, the rest go on
                log.exception("request %s (%s) failed", entry.request_id, entry.kind)
                outcome = _failed(entry, f"{type(e).__name__}: {e}", Category.SERVER)
            try:
                await self.settle(entry, outcome)
            finally:
                done.set()

        self._spawn(finish())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """A task the service keeps a reference to until it is done."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def submit_batch(self, snapshot: str | None, batch: Batch[Entry]) -> None:
        """Generate `batch` (batching.py) on the model thread in its turn; each request in
        it is answered with its own rows, and a failure fails them all."""

        def work() -> list[bytes]:
            spec = self.batches.take(snapshot, batch)  # closed: the members are final
            seqs, prompt_lp = self.model.sample(snapshot, spec)
            if len(batch.members) > 1:
                log.debug("%d sample requests as one batch of %d", len(batch.members), len(seqs))
            return [wire.write_sample_response(seqs[rows], prompt_lp) for _, rows in batch.slices()]

        queued = asyncio.get_running_loop().run_in_executor(self.thread, work)

        async def finish() -> None:
            results: list[bytes] = []
            failure: tuple[str, Category] | None = None
            try:
                results = await queued
            except TinkerUserError as e:
                failure = (str(e), Category.USER)
            except Exception as e:  # a server fault: these requests fail, loudly
                log.exception("sample batch of %d requests failed", len(batch.members))
                failure = (f"{type(e).__name__}: {e}", Category.SERVER)
            # Only now final: requests join the batch until the model thread takes it.
            entries = [entry for entry, _ in batch.members]
            if failure is None:
                outcomes = [
                    Outcome(e.request_id, False, r) for e, r in zip(entries, results, strict=True)
                ]
            else:
                outcomes = [_failed(entry, *failure) for entry in entries]
            try:
                for entry, outcome in zip(entries, outcomes, strict=True):
                    await self.settle(entry, outcome)
            finally:
                for entry in entries:
                    self._finished.setdefault(entry.request_id, asyncio.Event()).set()

        self._spawn(finish())

    # -- replay checkpoints (journal.py, checkpoint.py) ---------------------------------

    def stepped(self) -> None:
        """An optim_step was applied: a checkpoint is due every journal_checkpoint_every
        of them (counted in a replay too, taken only once serving)."""
        every = self.settings.journal_checkpoint_every
        if self.journal is None or every == 0:
            return
        self.steps_since_checkpoint += 1
        self._checkpoint_if_due()

    def _checkpoint_if_due(self) -> None:
        due = self.steps_since_checkpoint >= self.settings.journal_checkpoint_every
        if due and self.replay is None and self._checkpointing is None:
            self.steps_since_checkpoint = 0
            task = asyncio.create_task(self.checkpoint())
            self._checkpointing = task
            task.add_done_callback(self._checkpoint_done)

    def _checkpoint_done(self, task: asyncio.Task[Checkpoint | None]) -> None:
        self._checkpointing = None
        # Steps that fell due while this one was written (a slow write, a busy machine)
        # get theirs now, not only at the next optim_step, which may never come.
        if not task.cancelled():
            self._checkpoint_if_due()

    async def checkpoint(self) -> Checkpoint | None:
        """Copy the state with every accepted request answered (no new one accepted
        meanwhile: the intake lock), write it, record it, purge what it makes unneeded.
        A failure is logged and leaves the journal whole (the next one is tried later)."""
        assert self.journal is not None and self.checkpoints is not None
        t0 = time.perf_counter()
        try:
            async with self.intake:
                while self._tasks:  # every accepted request answered and its outcome logged
                    await asyncio.wait(set(self._tasks))
                captured = await self._capture(await self.journal.last_seq())
            held = time.perf_counter() - t0
            cp = await asyncio.to_thread(self.checkpoints.write, captured)
            await self.journal.append(cp)
        except Exception:
            log.exception("the journal's replay checkpoint failed; the journal stays whole")
            return None
        previous, self.last_checkpoint = self.last_checkpoint, cp
        if previous is not None:  # its records stay: a fallback if this directory is lost
            try:
                await self.journal.purge_before(previous.covers + 1)
                await asyncio.to_thread(self.checkpoints.remove_before, previous.covers)
            except Exception:  # recorded, not yet purged: the next checkpoint purges more
                log.exception("the journal's purge behind checkpoint %s failed", cp.directory)
        log.info("journal %s: replay checkpoint %s covers sequence %d (%d models, %d "
                 "requests); requests held %.3f s, written in %.3f s", self.journal.stream,
                 cp.directory, cp.covers, len(captured.models), len(captured.entries), held,
                 time.perf_counter() - t0)  # fmt: skip
        return cp

    async def _capture(self, covers: int) -> Captured:
        # The answers kept since the last checkpoint go now; this one's, at the next.
        self.log.expire(self._answers_to_expire, EXPIRED)
        entries, keys = self.log.entries()
        if any(e.state is State.PENDING for e in entries):
            raise RuntimeError("a request is pending with none in flight")  # an invariant
        self._answers_to_expire = {e.request_id for e in entries}
        engine_dirs = None
        if self.engines is not None:
            engine_dirs = {k: self.engines.dir / n for k, n in self.engines.names.items()}
        models, tensors = await asyncio.get_running_loop().run_in_executor(
            self.thread,
            copy_models,
            self.model,
            list(self.registry.models.values()),
            engine_dirs,
        )
        owners = {s.snapshot: s.model_id for s in self.registry.samplers.values()}
        snapshots = {}
        for key, t in tensors.items():
            model_id = owners.get(key)
            if model_id is not None:  # None: a sampler this server never handed out
                snapshots[key] = (model_id, t)
        return Captured(
            covers=covers,
            base_model=self.base_name,
            sessions={k: list(v) for k, v in self.registry.sessions.items()},
            models=models,
            samplers=list(self.registry.samplers.values()),
            snapshots=snapshots,
            entries=[dataclasses.replace(e) for e in entries],
            keys=keys,
        )

    async def restore(self, cp: Checkpoint) -> None:
        """Start from checkpoint `cp` (its directory is whole): the models on the model
        thread, the samplers' adapters on the engines, the registry and request log."""
        assert self.checkpoints is not None
        captured = await asyncio.to_thread(self.checkpoints.read, cp)
        if captured.base_model != self.base_name:
            raise JournalCorrupt(f"checkpoint {cp.directory} is of base model "
                                 f"{captured.base_model!r}; this server serves "
                                 f"{self.base_name!r}")  # fmt: skip
        await asyncio.get_running_loop().run_in_executor(
            self.thread, restore_models, self.model, captured, self.engines is None
        )
        if self.engines is not None:
            for key, (model_id, tensors) in captured.snapshots.items():
                rank = captured.models[_index(captured, model_id)].lora[0]
                await self.engines.publish(key, tensors, rank, self.base_name)
        self.registry.sessions.update(captured.sessions)
        self.registry.models.update({m.model.model_id: m.model for m in captured.models})
        self.registry.samplers.update({s.sampling_session_id: s for s in captured.samplers})
        self.log.restore(captured.entries, captured.keys)
        self._answers_to_expire = {e.request_id for e in captured.entries}
        self.last_checkpoint = cp

    def refuse(self, entry: Entry, error: TinkerUserError) -> None:
        self._spawn(self.settle(entry, _failed(entry, str(error), Category.USER)))

    # -- the journal (journal.py): a no-op without [tinker] journal_stream ---------------

    async def accept(self, request: web.Request, entry: Entry, reads_only: bool = False) -> bool:
        """Log a new request before its future id is answered. False: the replay answers
        it from its record (a read that finished before the restart); do not run it."""
        if self.journal is None:
            return True
        if self.replay is not None:  # replaying: it is logged already
            current = self.replay.current
            if current is not None and self.replay.answered_from_record(current):
                self._answer(entry, self.replay.outcomes[current.request_id])
                return False
            return True
        intake = Intake(entry.request_id, request.path, await request.read(), reads_only)
        try:
            await self.journal.append(intake)
        except JournalUnavailable:
            self.log.forget(entry)  # never accepted: the SDK's retry is a new request
            raise
        return True

    async def accept_plain(self, request: web.Request, created: str) -> None:
        """Log a request that is answered at once with the id it `created` (a session, a
        sampling session), before that answer."""
        if self.journal is not None and self.replay is None:
            await self.journal.append(Intake(created, request.path, await request.read()))

    def replayed_id(self) -> str | None:
        """The id the request being replayed created (None: not replaying)."""
        current = self.replay.current if self.replay is not None else None
        return current.request_id if current is not None else None

    async def settle(self, entry: Entry, outcome: Outcome) -> None:
        """Record a finished request's outcome in the journal, then answer it. A replayed
        request that has a recorded outcome is answered with that one (what its client
        may already hold): a rerun that differs is logged, not hidden."""
        recorded = self.replay.outcomes.get(entry.request_id) if self.replay else None
        if recorded is not None:
            if not recorded.same(outcome):
                log.warning("replayed request %s (%s) answered otherwise than its record "
                            "(%s, now %s); the record stands", entry.request_id, entry.kind,
                            _said(recorded), _said(outcome))  # fmt: skip
            outcome = recorded
        elif self.journal is not None:
            try:
                await self.journal.append(outcome)
            except JournalUnavailable:
                # Answered anyway: its intake is logged, so a restart runs it again.
                log.exception("the outcome of %s was not journaled", entry.request_id)
        self._answer(entry, outcome)

    def _answer(self, entry: Entry, outcome: Outcome) -> None:
        if outcome.failed:
            self.log.fail(entry, outcome.error, Category(outcome.category))
        else:
            self.log.complete(entry, outcome.result)
        self._finished.setdefault(entry.request_id, asyncio.Event()).set()

    async def wait(self, entry: Entry, timeout: float | None) -> None:
        done = self._finished.setdefault(entry.request_id, asyncio.Event())
        if entry.state is State.PENDING:
            try:
                await asyncio.wait_for(done.wait(), timeout)
            except TimeoutError:
                pass  # still running: the client is told to try again


Handler = Callable[[web.Request, Service], Awaitable[web.StreamResponse]]


def _index(captured: Captured, model_id: str) -> int:
    return [m.model.model_id for m in captured.models].index(model_id)


def _failed(entry: Entry, error: str, category: Category) -> Outcome:
    return Outcome(entry.request_id, True, error=error, category=category.value)


def _said(outcome: Outcome) -> str:
    """An outcome, short, for a log line."""
    if outcome.failed:
        return f"failed: {outcome.error}"
    if isinstance(outcome.result, bytes):
        digest = hashlib.sha256(outcome.result).hexdigest()[:12]
        return f"{len(outcome.result)} bytes, sha256 {digest}"
    return repr(outcome.result)[:200]


def _json_error(status: int, message: str, category: Category = Category.USER) -> web.Response:
    return web.json_response({"error": message, "category": category.value}, status=status)


# -- service routes ----------------------------------------------------------------------


async def client_config(request: web.Request, svc: Service) -> web.Response:
    # API-key auth (no JWT exchange), plain httpx, uncompressed protobuf; the SDK splits
    # a forward_backward into requests of at most max_datums datums.
    return web.json_response(
        {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": svc.settings.max_datums,
        }
    )


async def dynamic_config(request: web.Request, svc: Service) -> web.Response:
    return web.json_response({"refresh_interval_sec": 300})


async def healthz(request: web.Request, svc: Service) -> web.Response:
    return web.json_response({"status": "ok"})


async def capabilities(request: web.Request, svc: Service) -> web.Response:
    model = {
        "model_name": svc.base_name,
        "max_context_length": svc.settings.max_tokens,
        "trainable": True,
        "sampleable": True,
    }
    return web.json_response({"supported_models": [model]})


async def create_session(request: web.Request, svc: Service) -> web.Response:
    await _body(request)
    session_id = svc.registry.new_session(svc.replayed_id())
    try:
        await svc.accept_plain(request, session_id)
    except JournalUnavailable:
        svc.registry.end_session(session_id)
        raise
    log.info("session %s created", session_id)
    return web.json_response({"type": "create_session", "session_id": session_id})


async def heartbeat(request: web.Request, svc: Service) -> web.Response:
    svc.registry.session(str((await _body(request)).get("session_id")))
    return web.json_response({"type": "session_heartbeat"})


async def finish_session(request: web.Request, svc: Service) -> web.Response:
    # ServiceClient.close: the session's adapters stay until the server restarts (this slice).
    session_id = request.match_info["session_id"]
    svc.registry.session(session_id)
    log.info("session %s finished: %s", session_id, (await _body(request)).get("reason"))
    return web.json_response({})


async def telemetry(request: web.Request, svc: Service) -> web.Response:
    return web.json_response({"status": "accepted"})  # the SDK's usage events: not kept


async def retrieve_future(request: web.Request, svc: Service) -> web.Response:
    entry = svc.log.get(str((await _body(request)).get("request_id")))
    await svc.wait(entry, LONG_POLL_S)
    if entry.state is State.PENDING:
        return web.json_response(
            {"type": "try_again", "request_id": entry.request_id, "queue_state": "active"}
        )
    if entry.state is State.FAILED:
        return web.json_response({"error": entry.error, "category": entry.category.value})
    if isinstance(entry.result, bytes):
        return web.Response(body=entry.result, content_type=PROTOBUF)
    return web.json_response(entry.result)


# -- training routes ---------------------------------------------------------------------


async def create_model(request: web.Request, svc: Service) -> web.Response:
    body = await _body(request)
    session_id = str(body.get("session_id"))
    seq = int(body.get("model_seq_id", 0))
    svc.registry.session(session_id)
    model_id = Registry.model_id_for(session_id, seq)
    entry, fresh = svc.log.open(session_id, "create_model", seq)

    def build() -> None:
        svc.check_base(body.get("base_model"))
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 0))
        check_rank(rank, svc.limits)
        # Seeded from the request, never from a counter of the server's: a replay
        # (journal.py) draws the same initial adapter.
        seed = lora.get("seed")
        seed = int(seed) if seed is not None else adapter_seed(svc.settings.seed, model_id)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise TinkerUserError(f"optimizer_config type {optimizer!r}: only 'adamw' is served")
        if model_id in svc.registry.models:
            raise TinkerUserError(f"model {model_id!r} exists (model_seq_id {seq} reused)")

        def work() -> None:
            svc.model.add_adapter(
                model_id,
                rank,
                seed,
                bool(lora.get("train_attn", True)),
                bool(lora.get("train_mlp", True)),
                bool(lora.get("train_unembed", True)),
            )

        def registered(_: None) -> dict[str, Any]:
            svc.registry.add_model(TrainingModel(model_id, session_id, rank))
            log.info("model %s: a rank-%d adapter on %s", model_id, rank, svc.base_name)
            return {"model_id": model_id, "type": "create_model"}

        svc.submit(entry, work, registered)

    await _submitted(svc, request, entry, fresh, build)
    return _future(entry, model_id)


async def get_info(request: web.Request, svc: Service) -> web.Response:
    model = svc.registry.model(str((await _body(request)).get("model_id")))
    return web.json_response(
        {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": svc.model.base.config.model_type,
                "model_name": svc.base_name,
                # A local directory: the SDK's get_tokenizer loads it without a hub.
                "tokenizer_id": str(svc.model_dir),
            },
            "is_lora": True,
            "lora_rank": model.rank,
            "model_name": svc.base_name,
        }
    )


async def forward_backward(request: web.Request, svc: Service) -> web.Response:
    if request.headers.get("Content-Encoding", "identity") != "identity":
        raise TinkerUserError("compressed forward_backward bodies are not accepted")
    req = wire.read_forward_backward(await request.read())
    svc.registry.model(req.model_id)
    entry, fresh = svc.log.open(req.model_id, "train", req.seq_id)

    def build() -> None:
        check_batch(req.loss, req.data, svc.limits, req.config)
        config = loss_config(req.loss, req.config)

        def work() -> bytes:
            outputs, metrics = svc.model.forward_backward(
                req.model_id, req.loss, req.data, not req.forward_only, config
            )
            return wire.write_forward_backward_output(outputs, metrics)

        svc.submit(entry, work)

    await _submitted(svc, request, entry, fresh, build, reads_only=req.forward_only)
    return _future(entry, req.model_id)


async def optim_step(request: web.Request, svc: Service) -> web.Response:
    body = await _body(request)
    model = svc.registry.model(str(body.get("model_id")))
    entry, fresh = svc.log.open(model.model_id, "train", body.get("seq_id"))

    def build() -> None:
        if "adam_params" not in body:
            raise TinkerUserError("optim_step without adam_params: only Adam(W) is served")
        adam = {k: float(v) for k, v in body["adam_params"].items()}
        if adam.get("learning_rate", 1e-4) < 0:
            raise TinkerUserError(f"learning_rate must be >= 0, got {adam['learning_rate']}")

        def stepped(metrics: dict[str, float]) -> dict[str, Any]:
            model.steps += 1
            svc.stepped()  # a replay checkpoint may be due
            return {"metrics": metrics}

        svc.submit(entry, lambda: svc.model.optim_step(model.model_id, adam), stepped)

    await _submitted(svc, request, entry, fresh, build)
    return _future(entry, model.model_id)


async def save_weights_for_sampler(request: web.Request, svc: Service) -> web.Response:
    body = await _body(request)
    model = svc.registry.model(str(body.get("model_id")))
    entry, fresh = svc.log.open(model.model_id, "train", body.get("seq_id"))

    def build() -> None:
        if body.get("kind", "snapshot") != "snapshot":
            raise UnsupportedRoute(f"save_weights_for_sampler kind {body.get('kind')!r}: "
                                   "only 'snapshot' is served")  # fmt: skip
        name = body.get("path")
        if name is not None:  # a named checkpoint, sampled later through its path
            key = f"tinker://{model.model_id}/sampler_weights/{name}"
            result = {"path": key, "type": "save_weights_for_sampler"}
        else:
            seq = body.get("sampling_session_seq_id")
            key = f"{model.session_id}:sample:{seq}"
            result = {"sampling_session_id": key, "type": "save_weights_for_sampler"}

        def saved(_: None) -> dict[str, Any]:
            svc.registry.add_sampler(SamplingSession(key, model.session_id, model.model_id, key))
            return result

        if svc.engines is None:
            svc.submit(entry, lambda: svc.model.snapshot(model.model_id, key), saved)
            return
        # The adapter's tensors are copied on the model thread in this request's turn
        # (queued now: after the client's earlier steps, before its later ones), then
        # written and loaded on the engines off that thread.
        copied = asyncio.get_running_loop().run_in_executor(
            svc.thread, svc.model.adapter_tensors, model.model_id
        )

        async def publish(engines: EngineSampling) -> dict[str, Any]:
            await engines.publish(key, await copied, model.rank, svc.base_name)
            return saved(None)

        svc.submit_async(entry, publish(svc.engines))

    await _submitted(svc, request, entry, fresh, build)
    return _future(entry, model.model_id)


# -- sampling routes ---------------------------------------------------------------------


async def create_sampling_session(request: web.Request, svc: Service) -> web.Response:
    body = await _body(request)
    session_id = str(body.get("session_id"))
    svc.registry.session(session_id)
    sid = f"{session_id}:sample:{body.get('sampling_session_seq_id')}"
    path = body.get("model_path")
    if path is not None:
        saved = svc.registry.sampler(str(path))  # a named save of this server's
        sampler = SamplingSession(sid, session_id, saved.model_id, saved.snapshot)
    else:
        svc.check_base(body.get("base_model"))
        sampler = SamplingSession(sid, session_id, None, None)
    await svc.accept_plain(request, sid)
    svc.registry.add_sampler(sampler)
    return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})


async def get_sampler(request: web.Request, svc: Service) -> web.Response:
    # What the SDK asks when a sampling client is made from a future (its base model).
    sampler = svc.registry.sampler(request.match_info["sampler_id"])
    snap = sampler.snapshot
    path = snap if snap is not None and snap.startswith("tinker://") else None
    return web.json_response(
        {"sampler_id": sampler.sampling_session_id, "base_model": svc.base_name, "model_path": path}
    )


_UNSERVED_SAMPLE_OPTIONS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


def _sample_spec(body: dict[str, Any]) -> SampleSpec:
    for key in _UNSERVED_SAMPLE_OPTIONS:
        if body.get(key):
            raise UnsupportedRoute(f"sample option {key} is not served yet")
    for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
        if body.get(key) is not None:
            raise UnsupportedRoute(f"sample option {key} is not served yet")
    tokens: list[int] = []
    for chunk in (body.get("prompt") or {}).get("chunks") or []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise TinkerUserError(f"prompt chunk {chunk.get('type')!r}: token chunks only")
        tokens.extend(int(t) for t in chunk.get("tokens") or [])
    params = body.get("sampling_params") or {}
    stop = params.get("stop")
    stop_tokens: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    if isinstance(stop, str):
        stop_strings = (stop,)
    elif isinstance(stop, list):
        if all(isinstance(s, int) for s in stop):
            stop_tokens = tuple(stop)
        else:
            stop_strings = tuple(str(s) for s in stop)
    return SampleSpec(
        prompt=tuple(tokens),
        num_samples=int(body.get("num_samples", 1)),
        max_tokens=int(params.get("max_tokens") or 16),
        temperature=float(params.get("temperature", 1.0)),
        top_k=int(params.get("top_k", -1)),
        top_p=float(params.get("top_p", 1.0)),
        seed=params.get("seed"),
        stop_tokens=stop_tokens,
        stop_strings=stop_strings,
        prompt_logprobs=bool(body.get("prompt_logprobs")),
    )


async def asample(request: web.Request, svc: Service) -> web.Response:
    body = await _body(request)
    sid = body.get("sampling_session_id")
    if sid is not None:
        sampler = svc.registry.sampler(str(sid))
        snapshot = sampler.snapshot
    elif body.get("model_path") is not None:
        sid, snapshot = None, svc.registry.sampler(str(body["model_path"])).snapshot
    else:
        svc.check_base(body.get("base_model"))
        sid, snapshot = None, None
    entry, fresh = svc.log.open(str(sid), "sample", body.get("seq_id") if sid else None)
    n = int(body.get("num_samples", 1))

    def build() -> None:
        spec = _sample_spec(body)
        check_sample(spec, svc.limits)
        if svc.engines is not None:  # the engines batch concurrent requests themselves
            svc.submit_async(entry, _engine_sample(svc.engines, snapshot, spec))
            return
        # Joins an open batch of the same prompt and parameters (batching.py: the
        # cookbook sends a group's replies as one request each), or opens one.
        batch = svc.batches.add(snapshot, spec, entry)
        if batch is not None:
            svc.submit_batch(snapshot, batch)

    await _submitted(svc, request, entry, fresh, build, reads_only=True)
    ids = [f"{entry.request_id}:{i}" for i in range(max(n, 0))]
    return _future(entry, None, sample_sequence_ids=ids)


async def _engine_sample(engines: EngineSampling, snapshot: str | None, spec: SampleSpec) -> bytes:
    seqs, prompt_lp = await engines.sample(snapshot, spec)
    return wire.write_sample_response(seqs, prompt_lp)


# -- the app -----------------------------------------------------------------------------

ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/api/v1/client/config", client_config),
    ("POST", "/api/v1/client/dynamic_config", dynamic_config),
    ("GET", "/api/v1/healthz", healthz),
    ("GET", "/api/v1/get_server_capabilities", capabilities),
    ("POST", "/api/v1/create_session", create_session),
    ("POST", "/api/v1/session_heartbeat", heartbeat),
    ("POST", "/api/v1/sessions/{session_id}/finish", finish_session),
    ("POST", "/api/v1/telemetry", telemetry),
    ("POST", "/api/v1/retrieve_future", retrieve_future),
    ("POST", "/api/v1/create_model", create_model),
    ("POST", "/api/v1/get_info", get_info),
    ("POST", "/api/v1/forward_backward", forward_backward),
    ("POST", "/api/v1/optim_step", optim_step),
    ("POST", "/api/v1/save_weights_for_sampler", save_weights_for_sampler),
    ("POST", "/api/v1/create_sampling_session", create_sampling_session),
    ("POST", "/api/v1/asample", asample),
    ("GET", "/api/v1/samplers/{sampler_id}", get_sampler),
]
# Without a key: what the SDK asks before it has authenticated anything.
OPEN_PATHS = frozenset({"/api/v1/client/config", "/api/v1/healthz"})


# The routes whose requests the journal logs (journal.py): they change or read state.
JOURNALED = frozenset(
    {
        "/api/v1/create_session",
        "/api/v1/create_model",
        "/api/v1/forward_backward",
        "/api/v1/optim_step",
        "/api/v1/save_weights_for_sampler",
        "/api/v1/create_sampling_session",
        "/api/v1/asample",
        "/api/v1/save_weights",
        "/api/v1/load_weights",
    }
)


def _wrap(handler: Handler, svc: Service) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        key = svc.settings.api_key
        if key is not None and request.path not in OPEN_PATHS:
            if request.headers.get("X-API-Key") != key.get_secret_value():
                return _json_error(401, "missing or wrong X-API-Key")
        try:
            if request.path not in JOURNALED:
                return await handler(request, svc)
            await request.read()  # the whole body before the lock: a slow upload blocks no one
            async with svc.intake:
                return await handler(request, svc)
        except UnknownName as e:
            return _json_error(404, str(e))
        except TinkerUserError as e:
            return _json_error(400, str(e))
        except JournalUnavailable as e:  # not accepted; a 5xx, which the SDK retries
            return _json_error(503, str(e), Category.SERVER)

    return handle


async def _unserved(request: web.Request) -> web.Response:
    # A 400, not a 404/5xx: the SDK retries 5xx forever and this will not change by retrying.
    return _json_error(400, f"{request.method} {request.path} is not served by this Flywheel "
                            "Tinker server yet (docs/tinker.md lists what is)")  # fmt: skip


def build_app(svc: Service) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    for method, path, handler in [*ROUTES, *STATE_ROUTES]:
        app.router.add_route(method, path, _wrap(handler, svc))
    app.router.add_route("*", "/api/v1/{tail:.*}", _unserved)
    return app


def create_service(settings: TinkerSettings) -> Service:
    assert settings.model is not None  # the CLI resolves it first
    if settings.num_threads:
        import torch

        torch.set_num_threads(settings.num_threads)
    model_dir = Path(settings.model)
    model = AdapterModel(model_dir, settings.lora_alpha, settings.seed, settings.batch_tokens)
    return Service(settings, model, model_dir)


async def serve(
    settings: TinkerSettings,
    stop: asyncio.Event,
    on_ready: Callable[[int], None] | None = None,
    create: Callable[[TinkerSettings], Service] = create_service,
) -> None:
    """Load the model, serve until `stop` is set. `on_ready(port)` once listening."""
    # The journal first: a NATS that cannot be reached fails the start before the model loads.
    journal = await Journal.open(settings) if settings.journal_stream else None
    try:
        svc = await asyncio.to_thread(create, settings)
        try:
            if journal is not None:
                from services.tinker.rebuild import rebuild

                svc.journal = journal
                routes = {path: handler for _, path, handler in [*ROUTES, *STATE_ROUTES]}
                await rebuild(svc, routes)
            await _listen(svc, settings, stop, on_ready)
        finally:
            if svc._checkpointing is not None:  # its temporary directory is swept at a start
                svc._checkpointing.cancel()
            svc.thread.shutdown(wait=False, cancel_futures=True)
            if svc.engines is not None:
                await svc.engines.close()
    finally:
        if journal is not None:
            await journal.close()


async def _listen(
    svc: Service,
    settings: TinkerSettings,
    stop: asyncio.Event,
    on_ready: Callable[[int], None] | None,
) -> None:
    runner = web.AppRunner(build_app(svc), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else settings.port
    log.info("tinker API for %s on http://%s:%d", svc.base_name, settings.host, port)
    if on_ready is not None:
        on_ready(port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()

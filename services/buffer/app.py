"""The buffer service: the thin NATS adapter around services.buffer.core.

Three message loops and one dispatcher share one `Assembler`:

- samples (SampleGroup) → offer → maybe publish TrainBatches → persist → ack;
  a dropped group (filtered, stale) is dead-lettered with its reason.
- weights.ready (WeightsReady) → the ready version rises → more admission.
- dead letters of tasks (PromptTask) → those tasks are answered: no group comes.
- the dispatcher publishes as many PromptTasks as admission allows.

Crash safety. The state (cursor, counters, next step, pending group
references) is written to a JetStream KV bucket *before* the message that
changed it is acked, and pending groups are kept as stream sequence numbers
in SAMPLES (limits retention), re-read on restart. Every publish carries a
deterministic Nats-Msg-Id, so redoing the work after a crash re-publishes
identical tasks and batches, which JetStream stores once.

Batches go through an outbox (KV key `outbox`): their composition (step,
created_at, group sequences) is stored, then the state that counts them as
batched, then they are published, then the outbox is emptied; a restart
publishes what the outbox still holds for steps the state has passed. Without
it a crash between publishing batch s and persisting the state let the
restarted buffer build a *different* batch s from groups arriving in another
order, which JetStream then dropped as a duplicate id: one group trained
twice (in s and later), another never.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from typing import TYPE_CHECKING

import msgpack
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto.codec import decode
from proto.errors import ProtocolError
from proto.messages import (
    DeadLetter,
    PromptTask,
    SampleGroup,
    SamplingParams,
    TrainBatch,
    WeightsReady,
)
from proto.streams import consumers_for, kv_bucket, stream_name
from proto.subjects import Subjects
from services.buffer.core import (
    Assembler,
    BufferState,
    Cursor,
    FailureWatch,
    GroupFilter,
    Policy,
    Verdict,
    admission,
    advance,
    epoch_order,
    group_failure,
    max_length,
    task_id,
    zero_variance,
)
from services.buffer.settings import BufferSettings
from services.common.errors import ConfigError, FlywheelError, PermanentError, RunHalted
from services.common.lifecycle import ServiceContext
from services.common.msgloop import DeadLetterPublisher, Delivery, pause, transient_errors
from services.common.nats_conn import ensure_consumer, ensure_kv
from services.common.publish import publish
from services.common.tasks.prompts import format_row
from services.common.tasks.taskset import TrainOrder

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

log = logging.getLogger(__name__)

STATE_KEY = "state"
OUTBOX_KEY = "outbox"


# ── state persistence ────────────────────────────────────────────────────────
def dump_state(state: BufferState, pending: list[tuple[str, int]]) -> bytes:
    return msgpack.packb(
        {
            "cursor": [state.cursor.epoch, state.cursor.offset],
            "dispatched": state.dispatched,
            "answered": state.answered,
            "next_step": state.next_step,
            "ready_version": state.ready_version,
            "settled": {k: list(v) for k, v in state.settled.items()},
            "pending": [list(p) for p in pending],
        }
    )


class BufferStateError(FlywheelError, ValueError):
    """The persisted buffer state cannot be read (corrupt, or written by an incompatible version).

    The buffer refuses to start rather than start over: a fresh state would
    re-dispatch the whole dataset and re-number steps the trainer has done.
    """


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BufferStateError(f"buffer state: {what} must be an integer >= 0, got {value!r}")
    return value


def _pair(value: object, what: str) -> list[object]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise BufferStateError(f"buffer state: {what} must be a pair, got {value!r}")
    return list(value)


def _str(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BufferStateError(f"buffer state: {what} must be a non-empty string, got {value!r}")
    return value


def load_state(data: bytes) -> tuple[BufferState, list[tuple[str, int]]]:
    """Parse what `dump_state` wrote; BufferStateError names what is wrong."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise BufferStateError(f"buffer state is not MessagePack: {e}") from e
    if not isinstance(d, dict):
        raise BufferStateError(f"buffer state must be a map, got {type(d).__name__}")
    missing = {"cursor", "dispatched", "answered", "next_step", "ready_version", "settled",
               "pending"} - set(d)  # fmt: skip
    if missing:
        raise BufferStateError(f"buffer state lacks {sorted(missing)}")
    epoch, offset = _pair(d["cursor"], "cursor")
    if not isinstance(d["settled"], dict):
        raise BufferStateError("buffer state: settled must be a map")
    settled: dict[str, tuple[int, str]] = {}
    for gid, v in d["settled"].items():
        step, verdict = _pair(v, f"settled[{gid!r}]")
        settled[_str(gid, "a settled group id")] = (
            _int(step, "a settled step"),
            _str(verdict, "a settled verdict"),
        )
    if not isinstance(d["pending"], list | tuple):
        raise BufferStateError("buffer state: pending must be a list")
    pending = []
    for p in d["pending"]:
        gid, seq = _pair(p, "a pending entry")
        pending.append((_str(gid, "a pending group id"), _int(seq, "a pending sequence")))
    state = BufferState(
        cursor=Cursor(_int(epoch, "cursor epoch"), _int(offset, "cursor offset")),
        dispatched=_int(d["dispatched"], "dispatched"),
        answered=_int(d["answered"], "answered"),
        next_step=_int(d["next_step"], "next_step"),
        ready_version=_int(d["ready_version"], "ready_version"),
        settled=settled,
    )
    if state.answered > state.dispatched:
        raise BufferStateError(
            f"buffer state: answered {state.answered} > dispatched {state.dispatched}"
        )
    return state, pending


def dump_outbox(batches: list[tuple[int, float, list[int]]]) -> bytes:
    """Batches decided but maybe not yet published: (step, created_at, SAMPLES seqs)."""
    return msgpack.packb([[step, at, list(seqs)] for step, at, seqs in batches])


def load_outbox(data: bytes) -> list[tuple[int, float, list[int]]]:
    """Parse what `dump_outbox` wrote (empty bytes: an empty outbox)."""
    if not data:
        return []
    try:
        doc = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise BufferStateError(f"buffer outbox is not MessagePack: {e}") from e
    if not isinstance(doc, list):
        raise BufferStateError(f"buffer outbox must be a list, got {type(doc).__name__}")
    out = []
    for entry in doc:
        if not isinstance(entry, list) or len(entry) != 3:
            raise BufferStateError(f"buffer outbox entry must be a triple, got {entry!r}")
        step, at, seqs = entry
        if not isinstance(at, float | int) or not isinstance(seqs, list):
            raise BufferStateError(f"buffer outbox entry {entry!r} has the wrong types")
        out.append((_int(step, "outbox step"), float(at), [_int(s, "outbox seq") for s in seqs]))
    return out


# ── metrics ──────────────────────────────────────────────────────────────────
class BufferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.dispatched = Counter(
            "flywheel_buffer_tasks_dispatched", "Tasks published.", registry=r
        )
        self.in_flight = Gauge(
            "flywheel_buffer_tasks_in_flight", "Tasks awaiting a group.", registry=r
        )
        self.groups = Counter(
            "flywheel_buffer_groups", "Sample groups received, by verdict.", ["verdict"], registry=r
        )
        self.staleness = Histogram(
            "flywheel_buffer_staleness_steps",
            "Steps between a group's weight version and the step it trains at.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )
        self.batches = Counter("flywheel_buffer_batches_published", "Train batches.", registry=r)
        self.next_step = Gauge("flywheel_buffer_next_step", "Step of the next batch.", registry=r)
        self.ready_version = Gauge(
            "flywheel_buffer_ready_version", "Version every engine serves.", registry=r
        )
        self.batches_ahead = Gauge(
            "flywheel_buffer_batches_ahead",
            "Batches published whose step is not yet trained into a ready version.",
            registry=r,
        )
        self.epoch = Gauge("flywheel_buffer_dataset_epoch", "Dataset epoch.", registry=r)
        self.batch_fill = Histogram(
            "flywheel_buffer_batch_fill_seconds",
            "Time from a batch's first accepted group to its publication.",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )


# ── wiring ───────────────────────────────────────────────────────────────────
def import_filter(ref: str) -> GroupFilter:
    module, _, name = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"[buffer] custom_filter {ref!r} cannot be imported: {e}") from e


def make_filters(s: BufferSettings) -> list[GroupFilter]:
    filters: list[GroupFilter] = []
    if s.filter_zero_variance:
        filters.append(zero_variance)
    if s.max_response_tokens is not None:
        filters.append(max_length(s.max_response_tokens))
    if s.custom_filter:
        filters.append(import_filter(s.custom_filter))
    return filters


class BufferService:
    """Owns the assembler and the KV state; its handlers are the message loops'."""

    def __init__(self, ctx: ServiceContext, settings: BufferSettings, kv: KeyValue) -> None:
        self.ctx = ctx
        self.s = settings
        self.kv = kv
        self.subjects = Subjects(settings.run)
        self.tasks = settings.task_set()
        self.loaded = self.tasks.load()  # ConfigError naming the key: exit 2 at start-up
        self.order = TrainOrder.build(self.loaded)
        self.watch = FailureWatch(settings.halt_after)
        self.halted: RunHalted | None = None
        self.policy = Policy(settings.groups_per_step, settings.max_staleness, settings.oversample)
        self.asm = Assembler(self.policy, BufferState(), make_filters(settings))
        self.pending_seqs: dict[str, int] = {}  # group id -> SAMPLES stream sequence
        self.metrics = BufferMetrics(ctx.registry)
        self.lock = asyncio.Lock()  # one state change (and its persist) at a time
        self.wake = asyncio.Event()  # admission may have changed
        self.dead_letters = DeadLetterPublisher(
            ctx.js,
            run=settings.run,
            service="buffer",
            max_payload=ctx.max_payload,
            registry=ctx.registry,
            subject=self.subjects.tasks,
        )
        self._order_epoch = -1
        self._order: list[int] = []
        self._fill_started: float | None = None

    # state
    async def restore(self) -> None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(STATE_KEY)
        except KeyNotFoundError:
            log.info("buffer: fresh start")
            return
        assert entry.value is not None
        state, pending = load_state(entry.value)
        self.asm.state = state
        for gid, seq in pending:
            raw = await self.ctx.js.get_msg(stream_name(self.s.run, "SAMPLES"), seq)
            self.asm.pending.append(decode(raw.data or b"", SampleGroup))
            self.pending_seqs[gid] = seq
        log.info(
            "buffer: resumed at step %d, cursor %s, %d pending groups, %d in flight",
            state.next_step, state.cursor, len(pending), state.in_flight,
        )  # fmt: skip
        await self._flush_outbox()

    async def _flush_outbox(self) -> None:
        """Publish the batches a crash may have left unpublished (ids de-duplicate the rest)."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(OUTBOX_KEY)
        except KeyNotFoundError:
            return
        outbox = load_outbox(entry.value or b"")
        stream = stream_name(self.s.run, "SAMPLES")
        for step, created_at, seqs in outbox:
            if step >= self.asm.state.next_step:
                continue  # the state never counted it: it will be decided again
            groups = [decode((await self.ctx.js.get_msg(stream, q)).data or b"", SampleGroup)
                      for q in seqs]  # fmt: skip
            await self._publish_batch(step, groups, created_at)
            log.info("buffer: re-published batch %d from the outbox", step)
        if outbox:
            await self.kv.put(OUTBOX_KEY, b"")

    async def persist(self) -> None:
        pending = [(g.group_id, self.pending_seqs[g.group_id]) for g in self.asm.pending]
        await self.kv.put(STATE_KEY, dump_state(self.asm.state, pending))
        self._update_gauges()

    def _update_gauges(self) -> None:
        st = self.asm.state
        self.metrics.in_flight.set(st.in_flight)
        self.metrics.next_step.set(st.next_step)
        self.metrics.ready_version.set(st.ready_version)
        self.metrics.batches_ahead.set(max(0, st.next_step - st.ready_version))
        self.metrics.epoch.set(st.cursor.epoch)

    # handlers
    async def on_group(self, group: SampleGroup, d: Delivery) -> None:
        async with self.lock:
            target = self.asm.target_step()
            verdict = self.asm.offer(group)
            self.metrics.groups.labels(verdict=str(verdict)).inc()
            if verdict == Verdict.DUPLICATE:
                return
            self._watch_group(group)
            if verdict == Verdict.ACCEPTED:
                self.pending_seqs[group.group_id] = d.stream_seq
                self.metrics.staleness.observe(target - group.weight_version)
                if self._fill_started is None:
                    self._fill_started = time.monotonic()
                await self._publish_ready_batches()
            await self.persist()
            self.wake.set()
        if verdict != Verdict.ACCEPTED:
            raise PermanentError(
                f"group {group.group_id} (version {group.weight_version}) dropped at step "
                f"{target}: {verdict}",
                reason=str(verdict),
                expected=True,  # counted on the status line, not a warning per group
            )

    async def _publish_ready_batches(self) -> None:
        """Outbox, then state, then publish (module docstring: why in this order)."""
        batches = []
        while (batch := self.asm.take_batch()) is not None:
            batches.append((batch[0], time.time(), batch[1]))
        if batches:
            outbox = [(step, at, [self.pending_seqs[g.group_id] for g in groups])
                      for step, at, groups in batches]  # fmt: skip
            await self.kv.put(OUTBOX_KEY, dump_outbox(outbox))
            await self.persist()
        for step, at, groups in batches:
            parts = await self._publish_batch(step, groups, at)
            for g in groups:
                self.pending_seqs.pop(g.group_id, None)
            self.metrics.batches.inc()
            if self._fill_started is not None:
                self.metrics.batch_fill.observe(time.monotonic() - self._fill_started)
            self._fill_started = time.monotonic() if self.asm.pending else None
            log.info("buffer: published batch %d (%d groups, %d parts)", step, len(groups), parts)
        if batches:
            await self.kv.put(OUTBOX_KEY, b"")
        self.asm.forget_before(self.asm.state.next_step - self.s.keep_settled_steps)

    async def _publish_batch(self, step: int, groups: list[SampleGroup], created_at: float) -> int:
        msg = TrainBatch(
            run=self.s.run,
            batch_id=f"{self.s.run}:step{step}",
            step=step,
            groups=tuple(groups),
            created_at=created_at,  # kept in the outbox: a re-publish is byte-identical
        )
        return await publish(self.ctx.js, self.subjects.batches, msg, self.ctx.max_payload)

    async def on_ready(self, msg: WeightsReady, d: Delivery) -> None:
        async with self.lock:
            if msg.version > self.asm.state.ready_version:
                self.asm.state.ready_version = msg.version
                await self.persist()
                log.info("buffer: version %d ready", msg.version)
        self.wake.set()

    async def on_dead_letter(self, msg: DeadLetter, d: Delivery) -> None:
        if msg.message_type != PromptTask.TYPE:
            return
        try:
            task = decode(msg.payload, PromptTask)
        except ProtocolError:
            return  # not a task we dispatched (garbage published to tasks)
        gid = f"{task.task_id}:a{task.attempt}"
        async with self.lock:
            if gid in self.asm.state.settled:
                return  # answered already (a group arrived, or counted before)
            self.asm.task_dead_lettered()
            self.asm.state.settled[gid] = (self.asm.state.next_step, f"task_{msg.reason}")
            await self.persist()
        if msg.reason != "max_deliver":  # retries ran out: transient causes, not a bug
            self._failed(msg.reason, msg.error)
        self.wake.set()

    # fail fast
    def _watch_group(self, group: SampleGroup) -> None:
        error = group_failure(group)
        if error is None:
            self.watch.succeeded()
        else:
            self._failed("verifier_error", error)

    def _failed(self, reason: str, error: str) -> None:
        if self.watch.failed(reason, error) and self.halted is None:
            self.halted = RunHalted(
                f"stopping the run: {self.watch.streak} tasks in a row failed the same way, "
                f"so every task will. The last: {self.watch.example}"
            )
            log.error("buffer: %s", self.halted)
            self.ctx.stop.set()

    # dispatch
    def _slot(self, epoch: int, offset: int) -> int:
        if epoch != self._order_epoch:
            self._order = epoch_order(self.s.seed, epoch, len(self.order))
            self._order_epoch = epoch
        return self._order[offset]

    def make_task(self, epoch: int, offset: int) -> PromptTask:
        """The task at `offset` of `epoch`: a row of one task, formatted by its spec.

        `env` names the task (its key in the run file's task spec) and
        `index` the row of that task's source: every service resolves the
        reward and the formatting from them. ConfigError: a bad row.
        """
        name, row_index = self.order.item(epoch, self._slot(epoch, offset))
        spec = self.loaded[name].spec
        row = self.loaded[name].rows.row(row_index)
        prompt, messages = format_row(spec, row)
        return PromptTask(
            run=self.s.run,
            task_id=task_id(self.s.run, epoch, offset),
            epoch=epoch,
            index=row_index,
            env=name,
            prompt=prompt,
            messages=messages,
            answer=row.answer,
            n=self.s.samples_per_prompt,
            sampling=SamplingParams(
                temperature=self.s.temperature,
                top_p=self.s.top_p,
                max_new_tokens=self.s.max_new_tokens,
                stop=self.s.stop,
            ),
            min_weight_version=self.asm.state.ready_version,
            created_at=time.time(),
        )

    async def _dispatch_one(self, epoch: int, offset: int) -> bool:
        """Publish one task; a row that cannot become a task is dead-lettered (False)."""
        try:
            task = self.make_task(epoch, offset)
        except (ConfigError, ValueError) as e:
            tid = task_id(self.s.run, epoch, offset)
            await self.dead_letters.publish(
                reason="bad_row",
                error=f"{type(e).__name__}: {e}",
                subject=self.subjects.tasks,
                payload=tid.encode(),
                delivered=0,
                origin=f"buffer:{tid}",
                where=tid,
            )
            self._failed("bad_row", str(e))
            return False
        await publish(self.ctx.js, self.subjects.tasks, task, self.ctx.max_payload)
        return True

    async def dispatch_once(self) -> int:
        async with self.lock:
            st = self.asm.state
            n = admission(st.ready_version, self.asm.filled, st.in_flight, self.policy)
            if n == 0:
                return 0
            cursor, taken = advance(st.cursor, len(self.order), n)
            for epoch, offset in taken:
                if not await self._dispatch_one(epoch, offset):
                    st.answered += 1  # its dead letter is its answer: no group comes
            st.cursor = cursor
            st.dispatched += n
            await self.persist()
        self.metrics.dispatched.inc(n)
        return n

    async def dispatch_loop(self, stop: asyncio.Event) -> None:
        transient = transient_errors()
        while not stop.is_set() and self.halted is None:
            self.wake.clear()
            try:
                await self.dispatch_once()
            except transient as e:
                # NATS away (restart, partition): the cursor was not advanced, so
                # the next round re-publishes the same task ids (de-duplicated).
                # Found by tests/chaos: this used to kill the buffer.
                log.warning("buffer: dispatch failed (%s: %s); retrying", type(e).__name__, e)
            await pause(stop, self.s.dispatch_interval_s, self.wake)


async def open_kv(ctx: ServiceContext, run: str) -> KeyValue:
    replicas = ctx.settings.nats.replicas
    return await ensure_kv(ctx.js, kv_bucket(run, "buffer"), replicas=replicas, history=1)


async def body(ctx: ServiceContext) -> None:
    settings = ctx.settings
    assert isinstance(settings, BufferSettings)
    consumers = consumers_for(settings.run)
    for role in ("buffer", "buffer-ready", "buffer-dlq"):
        await ensure_consumer(ctx.js, consumers[role])
    svc = BufferService(ctx, settings, await open_kv(ctx, settings.run))
    await svc.restore()
    svc._update_gauges()
    groups = ctx.message_loop(consumers["buffer"], SampleGroup, svc.on_group)
    ready = ctx.message_loop(consumers["buffer-ready"], WeightsReady, svc.on_ready)
    dead = ctx.message_loop(consumers["buffer-dlq"], DeadLetter, svc.on_dead_letter)
    ctx.readiness.ok("buffer")
    await asyncio.gather(
        groups.run(ctx.stop), ready.run(ctx.stop), dead.run(ctx.stop), svc.dispatch_loop(ctx.stop)
    )
    if svc.halted is not None:
        raise svc.halted

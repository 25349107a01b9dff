"""The buffer service: the thin NATS adapter around services.buffer.core.

Three message loops and one dispatcher share one `Assembler`:

- samples (SampleGroup) → offer → maybe publish TrainBatches → persist → ack;
  a dropped group (filtered, stale) is dead-lettered with its reason.
- weights.ready (WeightsReady) → the ready version rises → more admission.
- dead letters of tasks (PromptTask) → those tasks are answered: no group comes.
- the dispatcher publishes as many PromptTasks as admission allows.

Crash safety. Every change of the state (a group's decision, a batch, the
cursor and counters) is written to a JetStream KV bucket *before* the message
that changed it is acked, one small write per change (services/buffer/state.py
says what is written, store.py how), and pending groups are kept as stream
sequence numbers in SAMPLES (limits retention), re-read on restart. Every
publish carries a deterministic Nats-Msg-Id, so redoing the work after a crash
re-publishes identical tasks and batches, which JetStream stores once.

A batch's composition (step, created_at, group sequences) is stored before it
is published, and the head's `published` moves past it after; a restart
publishes the stored batches from `published` on. Without that a crash
between publishing batch s and storing it let the restarted buffer build a
*different* batch s from groups arriving in another order, which JetStream
then dropped as a duplicate id: one group trained twice (in s and later),
another never.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter

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
from proto.streams import consumers_for, stream_name
from proto.subjects import Subjects
from services.buffer.admission import Policy, admission
from services.buffer.collapse import (
    StallWatch,
    StepWindow,
    all_solved_line,
    is_flat,
    retirement_note,
)
from services.buffer.core import (
    Assembler,
    BufferState,
    Cursor,
    FailureWatch,
    PromptTaskMaker,
    Verdict,
    group_failure,
    make_filters,
    position_of,
    scored_part,
    task_id,
    unscored,
)
from services.buffer.curriculum import (
    Difficulty,
    PromptKey,
    PromptStats,
    coin,
    difficulty,
    draw,
    observe,
    params_of,
    skip_reason,
)
from services.buffer.metrics import BufferMetrics
from services.buffer.settings import BufferSettings
from services.buffer.state import dump_accepted, dump_head, dump_settled
from services.buffer.store import StateStore, open_store
from services.runtime.errors import ConfigError, PermanentError, RunDone, RunHalted
from services.runtime.lifecycle import ServiceContext
from services.runtime.msgloop import DeadLetterPublisher, Delivery, pause, transient_errors
from services.runtime.nats_conn import ensure_consumer
from services.runtime.publish import publish

log = logging.getLogger(__name__)


class BufferService:
    """Owns the assembler and the KV state; its handlers are the message loops'."""

    def __init__(self, ctx: ServiceContext, settings: BufferSettings, store: StateStore) -> None:
        self.ctx = ctx
        self.s = settings
        self.store = store
        self.subjects = Subjects(settings.run)
        self.tasks = settings.task_set()
        self.loaded = self.tasks.load()  # ConfigError naming the key: exit 2 at start-up
        sampling = SamplingParams(
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_new_tokens=settings.max_new_tokens,
            stop=settings.stop,
        )
        self.task_maker = PromptTaskMaker(
            settings.run,
            self.loaded,
            seed=settings.seed,
            n=settings.samples_per_prompt,
            sampling=sampling,
        )
        self.watch = FailureWatch(settings.halt_after)
        self.halted: RunHalted | None = None
        self.policy = Policy(
            settings.groups_per_step,
            settings.max_staleness,
            oversample=settings.oversample,
            max_oversample=settings.max_oversample,
            margin=settings.oversample_margin,
        )
        g = settings.groups_per_step
        self.asm = Assembler(
            self.policy,
            BufferState(),
            make_filters(settings),
            min_scored=settings.min_scored_per_group,
            refill_max=math.floor(settings.refill_max_share * g),
            refill_max_staleness=settings.refill_max_staleness,
        )
        # the curriculum (durable: restored from the bucket) and collapse made visible
        self.curriculum = params_of(settings)
        self.prompts: dict[PromptKey, PromptStats] = {}
        self.census: Counter[str] = Counter()
        self.window = StepWindow(per_step=g)
        self.stall = StallWatch(
            limit=math.ceil(settings.stall_warn_steps * g),
            pass_reward=settings.curriculum_pass_reward,
        )
        self.batched_seqs: dict[str, int] = {}  # recent batched group id -> SAMPLES seq
        self._said_exhausted = False  # "every prompt is retired or resting", said once
        # the training set's distinct prompts: every row of every task's train split
        self.prompt_total = sum(len(t.train) for t in self.task_maker.order.tasks)
        self._said_solved = False  # "the whole training set is solved", said once
        self._said_stale = False  # a fixed oversample's stale drops, said once
        self.done: RunDone | None = None  # set when it is and on_solved = "stop"
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
        self._fill_started: float | None = None
        self.unpublished: list[tuple[int, float, list[SampleGroup]]] = []  # step, at, groups
        # when each step began filling (this process's clock), for settled_horizon
        self._step_starts: dict[int, float] = {0: time.monotonic()}

    # state
    async def restore(self) -> None:
        rec = await self.store.load()
        if rec.fresh:
            log.info("buffer: fresh start")
            return
        state = self.asm.state = rec.state
        self.prompts = rec.prompts
        self.census = Counter(str(difficulty(s, self.curriculum)) for s in rec.prompts.values())
        # Steps before this one began no later than now: none is forgotten for keep_settled_s.
        self._step_starts = {state.next_step: time.monotonic()}
        for gid, seq in rec.pending:
            self.asm.pending.append(await self._stored_group(seq))
            self.pending_seqs[gid] = seq
        for step, at, seqs in rec.unpublished:  # a crash may have left them unpublished
            self.unpublished.append((step, at, [await self._stored_group(q) for q in seqs]))
            log.info("buffer: re-publishing batch %d", step)
        log.info(
            "buffer: resumed at step %d, cursor %s, %d pending groups, %d in flight",
            state.next_step,
            state.cursor,
            len(rec.pending),
            state.in_flight,
        )
        await self._publish_ready_batches()  # and a full batch a crash left undecided
        await self.persist()

    async def _stored_group(self, seq: int) -> SampleGroup:
        """An accepted group as it was accepted: its scored samples (core.scored_part)."""
        raw = await self.ctx.js.get_msg(stream_name(self.s.run, "SAMPLES"), seq)
        return scored_part(decode(raw.data or b"", SampleGroup))

    def _head(self) -> bytes:
        """The head: counters, and the first step not yet published."""
        return dump_head(self.asm.state, self.asm.state.next_step - len(self.unpublished))

    def _record(self, gid: str, seq: int | None) -> None:
        """Queue a group's decision: accepted (its SAMPLES seq) or settled (dropped)."""
        st = self.asm.state
        if seq is not None:
            self.store.group(gid, dump_accepted(st.answered, seq))
        else:
            self.store.group(gid, dump_settled(st.answered, *st.settled[gid]))

    async def persist(self) -> None:
        await self.store.flush()
        self._update_gauges()

    def _update_gauges(self) -> None:
        st = self.asm.state
        self.metrics.in_flight.set(st.in_flight)
        self.metrics.next_step.set(st.next_step)
        self.metrics.ready_version.set(st.ready_version)
        self.metrics.batches_ahead.set(max(0, st.next_step - st.ready_version))
        self.metrics.epoch.set(st.cursor.epoch)
        shown = self.window.shown()
        self.metrics.flat_share.set(shown.flat_share)
        self.metrics.distinct.set(shown.distinct_mean)
        self.metrics.group_samples.set(shown.group_size)
        self.metrics.untrainable.set(self.stall.streak.groups)
        for d in Difficulty:
            if d is not Difficulty.UNSEEN:
                self.metrics.prompts.labels(difficulty=str(d)).set(self.census[str(d)])

    # handlers
    async def on_group(self, group: SampleGroup, d: Delivery) -> None:
        async with self.lock:
            target, answered = self.asm.target_step(), self.asm.state.answered
            verdict = self.asm.offer(group)
            self.metrics.groups.labels(verdict=str(verdict)).inc()
            if verdict == Verdict.DUPLICATE:
                await self.store.flush()  # its decision may still be queued (a failed write)
                return
            if self.asm.state.answered > answered:  # decided now, not a redelivered drop
                self._record(group.group_id, d.stream_seq if verdict == Verdict.ACCEPTED else None)
                self.metrics.unscored_samples.inc(unscored(group))
                self._learn(group, verdict)
            tokens = sum(s.num_response_tokens for s in group.samples)
            self.metrics.group_tokens.labels(verdict=str(verdict)).inc(tokens)
            self.metrics.filter_rate.set(self.asm.rate)
            self._watch_group(group)
            if verdict == Verdict.ACCEPTED:
                self.pending_seqs[group.group_id] = d.stream_seq
                self.metrics.staleness.observe(target - group.weight_version)
            if verdict == Verdict.ACCEPTED or self.asm.last_refill is not None:
                if self._fill_started is None:
                    self._fill_started = time.monotonic()
                await self._publish_ready_batches()
            await self.persist()
            self.wake.set()
        if verdict == Verdict.UNSCORED:  # a failure, not a decision: a dead letter to read
            first = next(s.verifier_error for s in group.samples if s.verifier_error)
            raise PermanentError(
                f"group {group.group_id}: {unscored(group)} of {len(group.samples)} rewards "
                f"could not be computed, too few left to train on ([buffer] "
                f"min_scored_per_group); e.g. {first}",
                reason=str(verdict),
                expected=True,  # the worker warned of the error; the status line counts these
            )
        if verdict != Verdict.ACCEPTED:
            raise PermanentError(
                f"group {group.group_id} (version {group.weight_version}) dropped at step "
                f"{target}: {verdict}",
                reason=str(verdict),
                expected=True,  # counted on the status line, not a warning per group
            )

    def _learn(self, group: SampleGroup, verdict: str) -> None:
        """What one decided group says of its prompt and of the policy (the curriculum,
        refills, the per-step figures, a stall)."""
        refill = self.asm.last_refill
        if refill is not None:  # the flat group's slot: a recent group trains again
            self.pending_seqs[refill.group_id] = self.batched_seqs[refill.group_id]
            self.metrics.refilled.inc()
        if verdict != Verdict.UNSCORED:
            self._observe_prompt(group)
            self.window.add(scored_part(group))
        if verdict == Verdict.STALE:
            self._stale_with_fixed_oversample()
        self.stall.observe(group, trainable=verdict == Verdict.ACCEPTED)
        line = self.stall.stalled(self.s.groups_per_step, self._retiring())
        if line is not None:
            self.metrics.stalls.inc()
            log.warning("buffer: %s", line)

    def _stale_with_fixed_oversample(self) -> None:
        """A fixed `oversample` dispatches beyond the staleness bound's slots, and the groups
        that arrive last, the longest replies, are the ones dropped: said once a run, on the
        first stale drop (the learned default paces dispatch: admission.py)."""
        if self.s.oversample is None or self._said_stale:
            return
        self._said_stale = True
        log.warning(
            "buffer: a group arrived too late for its step and was dropped as stale: [buffer] "
            "oversample = %s (fixed) dispatches more than the staleness bound lets train, and "
            "the slowest groups, those with the longest replies, are the ones dropped (measured: "
            "trained replies 15%% shorter than generated, bench/results_staleness_lengths.md). "
            "Unset [buffer] oversample to pace dispatch by the bound (the default); the status "
            "line counts stale drops",
            self.s.oversample,
        )

    def _retires(self) -> bool:
        return self.curriculum.enabled and self.curriculum.retire_after > 0

    def _retiring(self) -> str:
        """What becomes of solved prompts, for a stall line (collapse.retirement_note)."""
        retired = self.census[str(Difficulty.RETIRED)]
        return retirement_note(retired, self.prompt_total, self._retires(), self.s.on_solved)

    def _all_solved(self) -> str | None:
        """The console line once every training prompt is retired (once a run), else None."""
        if self._said_solved or not self._retires() or not self.prompt_total:
            return None
        if self.census[str(Difficulty.RETIRED)] < self.prompt_total:
            return None
        self._said_solved = True
        c = self.curriculum
        return all_solved_line(
            self.prompt_total, c.retire_pass_rate, c.retire_after, self.s.on_solved
        )

    def _observe_prompt(self, group: SampleGroup) -> None:
        """The group's prompt's pass rate (and rest), stored with the group's decision."""
        pos = position_of(group.task_id)
        if pos is None:
            return
        try:
            key = self.task_maker.key(*pos)
        except IndexError:  # a position past this dataset (its run file changed)
            return
        old = self.prompts.get(key)
        scored = [s.reward for s in group.samples if s.verifier_error is None]
        new = observe(old, scored, step=self.asm.state.next_step, params=self.curriculum)
        if new is None or new == old:
            return
        if old is not None:
            self.census[str(difficulty(old, self.curriculum))] -= 1
        self.census[str(difficulty(new, self.curriculum))] += 1
        if new.rest_until > (old.rest_until if old else 0) and is_flat(group):
            self.metrics.rested.inc()
        self.prompts[key] = new
        self.store.prompt(key, new)

    async def _publish_ready_batches(self) -> None:
        """Store the batch, then publish it (module docstring: why in this order). Taken
        batches wait in `unpublished` until published: a failed KV write or publish leaves
        them to the next call (else a step was lost: `make chaos`, a write timed out)."""
        while (batch := self.asm.take_batch()) is not None:
            step, groups = batch
            self.unpublished.append((step, time.time(), groups))
            seqs = [self.pending_seqs[g.group_id] for g in groups]
            self.store.batch(step, self.unpublished[-1][1], seqs)
            # what a refill could still take (core.Assembler.recent), by SAMPLES sequence
            recent = {g.group_id for g in self.asm.recent}
            known = {**self.batched_seqs}
            known.update((g.group_id, q) for g, q in zip(groups, seqs, strict=True))
            self.batched_seqs = {gid: q for gid, q in known.items() if gid in recent}
        await self.store.flush()
        published = bool(self.unpublished)
        while self.unpublished:
            step, at, groups = self.unpublished[0]
            parts = await self._publish_batch(step, groups, at)
            self.unpublished.pop(0)
            for g in groups:
                self.pending_seqs.pop(g.group_id, None)
            self.window.closed()
            self.metrics.batches.inc()
            if self._fill_started is not None:
                self.metrics.batch_fill.observe(time.monotonic() - self._fill_started)
            self._fill_started = time.monotonic() if self.asm.pending else None
            log.info("buffer: published batch %d (%d groups, %d parts)", step, len(groups), parts)
        if published:
            self.store.head(self._head())
        now, keep = time.monotonic(), (self.s.keep_settled_s, self.s.keep_settled_steps)
        self._step_starts = self.asm.forget_settled(self._step_starts, now, *keep)
        below = min(self.asm.forgotten_below, self.asm.state.next_step - len(self.unpublished))
        self.store.forget(self.asm.state, self.pending_seqs, below, self._head())

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
                self.store.head(self._head())
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
            if gid in self.asm.state.settled or gid in self.pending_seqs:
                return  # answered already (a group arrived, or counted before)
            self.asm.task_dead_lettered()
            self.asm.state.settled[gid] = (self.asm.state.next_step, f"task_{msg.reason}")
            self._record(gid, None)
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
    def make_task(self, epoch: int, offset: int) -> PromptTask:
        """The task at `offset` of `epoch` (core.PromptTaskMaker); ConfigError: a bad row."""
        return self.task_maker.task(epoch, offset, self.asm.state.ready_version, time.time())

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
            if self.unpublished:  # left by a failed write; with admission full, no group comes
                await self._publish_ready_batches()
            solved = self._all_solved()
            if solved is not None and self.s.on_solved == "stop":
                # the run's end (RunDone: `flywheel up` stops the whole run, no restart),
                # said by the service's exit line; every group from here on would be flat
                self.done = RunDone(solved)
                self.ctx.stop.set()
                return 0
            if solved is not None:
                log.warning("buffer: %s", solved)
            st = self.asm.state
            a = self.asm
            n = admission(st.ready_version, a.filled, st.in_flight, self.policy, a.rate, a.evidence)
            if n == 0:
                return 0
            got = draw((st.cursor.epoch, st.cursor.offset), len(self.task_maker), n, self._skip)
            for epoch, offset in got.taken:
                if not await self._dispatch_one(epoch, offset):
                    st.answered += 1  # its dead letter is its answer: no group comes
            st.cursor = Cursor(*got.cursor)
            for reason, k in got.skipped.items():
                self.metrics.skipped.labels(reason=reason).inc(k)
            if got.forced and not self._said_exhausted and not self._said_solved:
                self._said_exhausted = True
                log.warning("buffer: every prompt is retired or resting; drawing them anyway "
                            "([buffer] curriculum_retire_*, flat_rest_steps)")  # fmt: skip
            st.dispatched += n
            self.store.head(self._head())
            await self.persist()
        self.metrics.dispatched.inc(n)
        return n

    def _skip(self, epoch: int, offset: int) -> str | None:
        """Why the curriculum passes over this position now (None: draw it)."""
        if not self.prompts:
            return None
        try:
            stats = self.prompts.get(self.task_maker.key(epoch, offset))
        except IndexError:
            return None
        if stats is None:  # never seen: drawn as always
            return None
        step = self.asm.state.next_step
        sure = skip_reason(stats, step, 0.0, self.curriculum)  # retired, resting, weight 0
        if sure is not None:
            return sure
        return skip_reason(stats, step, coin(self.s.seed, epoch, offset), self.curriculum)

    async def dispatch_loop(self, stop: asyncio.Event) -> None:
        transient = transient_errors()
        while not stop.is_set() and self.halted is None and self.done is None:
            self.wake.clear()
            try:
                await self.dispatch_once()
            except transient as e:
                # NATS away (restart, partition): the cursor was not advanced, so
                # the next round re-publishes the same task ids (de-duplicated).
                # Found by tests/chaos: this used to kill the buffer.
                log.warning("buffer: dispatch failed (%s: %s); retrying", type(e).__name__, e)
            await pause(stop, self.s.dispatch_interval_s, self.wake)


async def body(ctx: ServiceContext) -> None:
    settings = ctx.settings
    assert isinstance(settings, BufferSettings)
    consumers = consumers_for(settings.run)
    for role in ("buffer", "buffer-ready", "buffer-dlq"):
        await ensure_consumer(ctx.js, consumers[role])
    svc = BufferService(ctx, settings, await open_store(ctx, settings.run))
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
    if svc.done is not None:
        raise svc.done

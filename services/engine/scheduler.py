"""Continuous batching: one thread owns the model and steps every live sequence together.

The loop (one iteration = at most one prefill and one decode step):

1. run the commands the HTTP side queued (submit, abort, pause, continue,
   update weights) — the only way state changes, so the thread needs no locks;
2. if a weight update is pending and nothing is decoding (or decoding is
   paused), load the new weights;
3. admit waiting sequences into free slots: one batched prefill samples their
   first token, then their cache rows join the decode batch (`kvbatch.join`);
4. one decode step for every running row; finished rows leave the batch.

New requests therefore join between decode steps instead of waiting for the
batch to drain (Orca's iteration-level scheduling, Yu et al., OSDI 2022).

Pause modes follow SGLang's `/pause_generation`: `abort` finishes every
request with an abort reason; `retract` drops running rows' KV and requeues
them at the front (they re-prefill prompt + generated tokens on continue);
`in_place` keeps rows and KV and just stops stepping. Requests that arrive
while generation is paused, or while an update waits, are *held*: SGLang
keeps them in its tokenizer manager (the pause condition, the weight lock),
outside the scheduler, so they count for nothing the scheduler checks.

A weight update asked for while generation runs waits, like SGLang's
writer lock, for every request admitted before it (running or waiting, not
held) to finish; one asked for while paused loads at once (SGLang takes no
lock then: 0.5.6+; 0.5.4 takes it, but its pause has aborted every reader).
Then, as SGLang's scheduler does, it records the version change on every
live request (tokens so far came from the old version: `weight_versions`
spans) and, if asked, flushes the prefix cache (`Batch.prefix_cache`: it
would otherwise serve prefixes the old weights computed, as SGLang's radix
cache does after an update without a flush), which needs no running request and
(before 0.5.22, or unpaused) no waiting one. A refused flush fails the
update with SGLang's 400 message (0.5.22+) or kills the scheduler as
SGLang's assertion did (`crashed`, before). Requests held by the update are
released only once it has answered, flush included: in every release from
0.5.4 to 0.5.23 the tokenizer manager holds the writer lock around
`_wait_for_model_update_from_disk` (and `update_weights_from_distributed`),
which returns after the scheduler's flush, so a request that arrives during
an update never is in the scheduler's queue when the flush looks at it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from services.engine.batch import Batch
from services.engine.core.lora import batch_fits
from services.engine.core.protocol import Completion, SeqSpec, version_spans
from services.engine.core.sequence import (
    PAUSE_MODES,
    SchedulerCrashed,
    SchedulerStopped,
    Seq,
    Update,
    UpdateRefused,
    answer,
)
from services.engine_api.sglang_api import (
    FLUSH_ASSERT,
    FLUSH_IN_PROGRESS,
    FLUSH_REFUSED,
    FLUSH_TIMED_OUT,
    Capabilities,
)

__all__ = ["PAUSE_MODES", "Scheduler", "SchedulerCrashed", "SchedulerStopped", "Seq"]

if TYPE_CHECKING:
    from services.engine.runner import ModelRunner

log = logging.getLogger(__name__)


class Scheduler:
    """The engine's state: waiting queue, running batch, pause flag, weight version."""

    def __init__(
        self,
        runner: ModelRunner,
        eos: frozenset[int],
        decode: Callable[[list[int], bool], str],
        weight_version: str = "default",
        max_running_requests: int = 64,
        random_seed: int = 0,
        caps: Capabilities | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.runner = runner
        self.caps = caps or Capabilities((0, 5, 23))
        # Two versions, as in SGLang: the one /model_info reports (the tokenizer
        # manager's, set only by a successful update) and the one the weights
        # are (the scheduler's, which stamps tokens).
        self.weight_version = weight_version
        self.served_version = weight_version
        self.crashed: str | None = None
        self._finished_at = 0.0
        self.max_running = max_running_requests
        self._batch = Batch(runner, eos, decode, random_seed, prefix_cache_bytes)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting: deque[Seq] = deque()
        self._paused = False
        self._update: Update | None = None
        # A /flush_cache?timeout= waiting for an idle moment: its answer and deadline.
        self._pending_flush: tuple[Future[tuple[bool, str]], float] | None = None
        self._stop = False
        self._step_sleep = 0.0  # SGLang's /slow_down, for tests that need requests mid-flight
        # LoRA (set by the LoRA routes, services/engine/lora_api.py): at most this many
        # distinct adapters (the base model counting as one) decode together, as
        # SGLang's `validate_lora_batch`; pinned adapters keep their own slots.
        self.max_loras_per_batch: int | None = None
        self.pinned_loras: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    # ---- thread-safe API (called from the event loop) --------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        def cmd() -> None:
            self._stop = True

        self._commands.put(cmd)
        self._thread.join(timeout)

    def submit(self, spec: SeqSpec, on_done: Callable[[Completion], None]) -> None:
        """Queue one sequence; `on_done` is called from the scheduler thread when it ends."""
        if not self.alive():
            raise self._stopped()
        seq = Seq(spec=spec, on_done=on_done, t0=time.perf_counter())

        def cmd() -> None:
            seq.held = self._paused or self._update is not None
            self._waiting.append(seq)

        self._commands.put(cmd)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> Future[int]:
        """Abort sequences whose request id (or completion id) is `rid`, or all; count them."""
        return self.run(lambda: self._abort_matching(rid, abort_all, "Abort requested"))

    def pause(self, mode: str) -> Future[None]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}")
        return self.run(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        def cmd() -> None:
            self._paused = False
            if self._update is None:
                self._release_held()

        return self.run(cmd)

    def update_weights(
        self, load: Callable[[], str], version: str | None, abort_all: bool, flush: bool = True
    ) -> Future[tuple[bool, str, int]]:
        """Update the weights with `load` (from disk, or received from a group), under
        the rules of the module docstring; resolves to (success, message, 0)."""
        fut: Future[tuple[bool, str, int]] = Future()

        def cmd() -> None:
            if self._update is not None:
                answer(fut, (False, "another weight update is in progress", 0))
                return
            if abort_all:
                self._abort_matching(None, True, "Aborted by a weight update")
            self._update = Update(load, version, flush, fut, locked=not self._paused)

        if not self.alive():
            fut.set_exception(self._stopped())
        else:
            self._commands.put(cmd)
        return fut

    def slow_down(self, seconds: float | None) -> Future[None]:
        """Sleep this long after every decode step (None/0: full speed). Testing only."""

        def cmd() -> None:
            self._step_sleep = max(0.0, seconds or 0.0)

        return self.run(cmd)

    def flush_possible(self) -> Future[bool]:
        """Whether SGLang would flush its cache now (without flushing it)."""
        return self.run(self._flush_possible)

    def flush_cache(self, timeout_s: float = 0.0) -> Future[tuple[bool, str]]:
        """`/flush_cache`: drop the prefix cache if SGLang would flush now; resolves to
        (flushed, SGLang's message). With `timeout_s` > 0 (0.5.10+) a flush that cannot
        happen now waits for the first idle moment (`is_fully_idle` counting the waiting
        queue, paused or not) and fails at the deadline, as SGLang's deferred flush; one
        such wait at a time."""

        fut: Future[tuple[bool, str]] = Future()

        def cmd() -> None:
            if self._pending_flush is not None:
                answer(fut, (False, FLUSH_IN_PROGRESS))
            elif timeout_s <= 0 or self._flush_possible(paused=False):
                answer(fut, (self._flush(), ""))
            else:
                self._pending_flush = (fut, time.monotonic() + timeout_s)

        if not self.alive():
            fut.set_exception(self._stopped())
        else:
            self._commands.put(cmd)
        return fut

    def prefix_cache_entries(self) -> Future[int]:
        """How many prefixes the cache holds (for tests and the bench)."""
        return self.run(lambda: len(self._batch.prefix_cache))

    def load(self) -> dict[str, Any]:
        """A racy but consistent-enough snapshot for /v1/loads (ints read atomically)."""
        held = sum(1 for s in list(self._waiting) if s.held)
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting) - held,
            "num_held_reqs": held,
            "num_used_tokens": self._batch.used_tokens(),
            "paused": self._paused,
            "update_pending": self._update is not None,
        }

    @property
    def generated_tokens(self) -> int:
        return self._batch.generated_tokens

    @property
    def last_output(self) -> float:
        """time.time() of the last token or completion: SGLang's health check waits for one."""
        return max(self._batch.last_output, self._finished_at)

    @property
    def _running(self) -> list[Seq]:
        return self._batch.seqs

    @property
    def paused(self) -> bool:
        return self._paused

    def _stopped(self) -> SchedulerStopped:
        return SchedulerStopped(self.crashed or "the engine scheduler is not running")

    def run(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the scheduler thread between steps (also SGLang's weights-update
        group requests: generation waits while a group forms)."""
        fut: Future[Any] = Future()

        def cmd() -> None:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 -- handed to the awaiting caller, who re-raises
                answer(fut, error=e)
            else:
                answer(fut, result)

        if not self.alive():
            fut.set_exception(self._stopped())
        else:
            self._commands.put(cmd)
        return fut

    # ---- scheduler thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands(block=not self._has_work())
                if self._stop:
                    break
                self._check_pending_flush()
                self._maybe_update()
                self._step()
        except SchedulerCrashed as e:
            # SGLang's scheduler process dies here and takes the server with it.
            log.critical("engine scheduler crashed: %s", e)
            return
        except Exception as e:  # a bug: say so, and let the server exit with it (app.serve)
            self.crashed = f"the engine scheduler crashed: {type(e).__name__}: {e}"
            log.critical(self.crashed, exc_info=True)
            return
        self._abort_matching(None, True, "Engine shutting down")
        if self._pending_flush is not None:
            answer(self._pending_flush[0], error=self._stopped())

    def _step(self) -> None:
        try:
            if not self._paused and self._admittable():
                self._admit()
            if self._running and not self._paused:
                self._decode_step()
        except Exception as e:  # e.g. out of memory: fail these requests, keep serving
            log.exception("engine step failed; aborting the running requests")
            self._abort_matching(None, True, f"engine error: {type(e).__name__}: {e}")
            self._batch.clear()

    def _admittable(self) -> bool:
        """Waiting sequences may start: all of them, or while an update waits only those
        admitted before it (SGLang's writer lock lets earlier readers finish)."""
        if self._update is None:
            return bool(self._waiting)
        return any(not s.held for s in self._waiting)

    def _blocking_update(self) -> bool:
        """Requests admitted before a pending (unpaused) update are still unfinished."""
        return bool(self._running) or any(not s.held for s in self._waiting)

    def _update_due(self) -> bool:
        """A pending update may load now: it holds no lock, or its readers are done."""
        upd = self._update
        return upd is not None and (not upd.locked or not self._blocking_update())

    def _has_work(self) -> bool:
        decoding = bool(self._running) and not self._paused
        admitting = not self._paused and self._admittable()
        flushing = self._pending_flush is not None and self._flush_possible(paused=False)
        return decoding or admitting or self._update_due() or flushing

    def _release_held(self) -> None:
        for seq in self._waiting:
            seq.held = False

    def _drain_commands(self, block: bool) -> None:
        if block:
            # A waiting flush must still see its deadline while nothing else happens.
            pending = self._pending_flush
            wait = None if pending is None else max(0.0, pending[1] - time.monotonic())
            try:
                self._commands.get(timeout=wait)()
            except queue.Empty:
                return
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _finish(self, seq: Seq, reason: dict[str, Any]) -> None:
        n = len(seq.output_ids)
        done = Completion(
            output_ids=seq.output_ids,
            logprobs=seq.logprobs,
            finish_reason=reason,
            weight_version=self.served_version,
            e2e_latency=time.perf_counter() - seq.t0,
            matched_stop_str=seq.matched_str,
            spans=version_spans(seq.events, self.served_version, n),
            retractions=seq.retractions,
            input_logprobs=seq.input_logprobs,
            cached_tokens=seq.cached_tokens or 0,
        )
        self._finished_at = time.time()
        try:
            seq.on_done(done)
        except Exception:  # a broken callback must not kill the engine thread
            log.exception("completion callback of %s failed", seq.spec.out_id)

    def _abort_matching(self, rid: str | None, abort_all: bool, message: str) -> int:
        def hit(s: Seq) -> bool:
            return abort_all or s.spec.rid == rid

        reason = {"type": "abort", "message": message, "status_code": None, "err_type": None}
        count = 0
        for seq in [s for s in self._waiting if hit(s)]:
            self._waiting.remove(seq)
            self._finish(seq, reason)
            count += 1
        keep = [i for i, s in enumerate(self._running) if not hit(s)]
        if len(keep) != len(self._running):
            for i, seq in enumerate(self._running):
                if i not in keep:
                    self._finish(seq, reason)
                    count += 1
            self._batch.keep(keep)
        return count

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort_matching(None, True, "Aborted by pause_generation")
        elif mode == "retract":
            retracted = self._batch.clear()
            for seq in retracted:
                seq.retractions += 1
            self._waiting.extendleft(reversed(retracted))
        self._paused = True

    def _maybe_update(self) -> None:
        upd = self._update
        if upd is None or not self._update_due():
            return
        self._update = None
        try:
            answer(upd.future, self._apply(upd))
        finally:
            # The writer lock goes only now, after the answer (flush included):
            # requests that came meanwhile enter the scheduler after it.
            if not self._paused:
                self._release_held()

    def _apply(self, upd: Update) -> tuple[bool, str, int]:
        """Load, record the version change, flush: SGLang's scheduler's answer."""
        try:
            message = upd.load()
        except UpdateRefused as e:
            log.warning("weight update refused: %s", e)
            return False, str(e), 0
        if upd.version is not None and upd.version != self.served_version:
            for seq in [*self._running, *self._waiting]:
                if seq.output_ids:
                    seq.events.append((self.served_version, len(seq.output_ids)))
            self.served_version = upd.version
        # An unlocked update was asked for while paused; SGLang's scheduler handles
        # it before any /continue_generation that came after it.
        if upd.flush and not self._flush(paused=self._paused or not upd.locked):
            if not self.caps.flush_refusal_is_400:
                why = f"AssertionError: {FLUSH_ASSERT}"
                self.crashed = f"the engine scheduler crashed: {why}"
                answer(upd.future, error=SchedulerCrashed(why))
                raise SchedulerCrashed(why)
            return False, FLUSH_REFUSED, 0
        if upd.version is not None:
            self.weight_version = upd.version
        return True, message, 0

    def _check_pending_flush(self) -> None:
        """SGLang's `check_pending`, once per loop after the commands: flush at the first
        idle moment, or answer the timeout."""
        if self._pending_flush is None:
            return
        fut, deadline = self._pending_flush
        if self._flush_possible(paused=False):
            self._pending_flush = None
            answer(fut, (self._flush(), ""))
        elif time.monotonic() >= deadline:
            log.warning("deferred flush_cache timed out while waiting for idle state")
            self._pending_flush = None
            answer(fut, (False, FLUSH_TIMED_OUT))

    def _flush(self, paused: bool | None = None) -> bool:
        """SGLang's `Scheduler.flush_cache`: drop every cached prefix, only when fully idle
        (a refused flush keeps them, also those the old weights computed)."""
        if not self._flush_possible(paused):
            log.warning("cache not flushed: requests are running or queued")
            return False
        dropped = self._batch.prefix_cache.clear()
        log.info("cache flushed (%d prefixes)", dropped)
        return True

    def _flush_possible(self, paused: bool | None = None) -> bool:
        """SGLang's `flush_cache` precondition (`is_fully_idle`): nothing running, and
        nothing waiting in the scheduler unless paused on 0.5.22+ (held ones are not in it)."""
        if self._running:
            return False
        if (self._paused if paused is None else paused) and self.caps.paused_flush_ignores_waiting:
            return True
        return not any(not s.held for s in self._waiting)

    def _admit(self) -> None:
        free = self.max_running - len(self._running)
        new: list[Seq] = []
        skipped: list[Seq] = []
        loras = {s.spec.lora_id for s in self._running}
        while self._waiting and len(new) < free:
            seq = self._waiting.popleft()
            if seq.held and self._update is not None:
                skipped.append(seq)  # behind the pending update's lock
                continue
            if not self._lora_fits(loras, seq.spec.lora_id):
                skipped.append(seq)  # SGLang's scheduler skips it and tries the next
                continue
            max_new = seq.spec.params.max_new_tokens
            self._score_prompts([seq])
            if max_new == 0 or len(seq.output_ids) >= max_new:
                self._finish(seq, {"type": "length", "length": max_new})
                continue
            new.append(seq)
            loras.add(seq.spec.lora_id)
        self._waiting.extendleft(reversed(skipped))
        if new:
            self._batch.admit(new, self._finish)

    def _score_prompts(self, seqs: list[Seq]) -> None:
        """Prompt logprobs (`logprob_start_len`) of the sequences that ask for some, once:
        SGLang computes them in the request's prefill and keeps them over a retraction."""
        for seq in seqs:
            start = seq.spec.input_start
            if seq.input_logprobs is None and start is not None and start < len(seq.spec.input_ids):
                seq.input_logprobs = self.runner.prompt_logprobs(
                    list(seq.spec.input_ids), start, seq.spec.lora_id
                )

    def _lora_fits(self, running: set[str | None], lora_id: str | None) -> bool:
        """`can_schedule_lora_req`: its adapter already runs, or one more still fits."""
        if self.max_loras_per_batch is None or lora_id in running:
            return True
        return batch_fits(running | {lora_id}, self.pinned_loras, self.max_loras_per_batch)

    def _decode_step(self) -> None:
        self._batch.decode(self._finish)
        if self._step_sleep:
            time.sleep(self._step_sleep)

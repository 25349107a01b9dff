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
`in_place` keeps rows and KV and just stops stepping. A weight update waits
for running rows to finish (admission stops meanwhile) unless it is told to
abort them, or generation is paused. Tokens of a request held across an
update come from both versions; `weight_version` in its reply is the version
at completion, as in SGLang.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.errors import FlywheelError
from services.rollout.engine import kvbatch
from services.rollout.engine.protocol import Completion, SeqSpec
from services.rollout.engine.runner import WeightsLoadError
from services.rollout.engine.sampling import sample_rows, uniform_noise

if TYPE_CHECKING:
    import torch

    from services.rollout.engine.runner import ModelRunner

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class SchedulerStopped(FlywheelError, RuntimeError):
    """The scheduler thread is gone; no request can be served."""


@dataclass
class Seq:
    """One sequence being generated (scheduler-thread state)."""

    spec: SeqSpec
    on_done: Callable[[Completion], None]
    t0: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: Any = None  # torch.Generator for seeded requests
    matched_str: str | None = None


def stop_reason(
    seq: Seq, eos: frozenset[int], decode: Callable[[list[int], bool], str]
) -> tuple[dict[str, Any] | None, str | None]:
    """The finish reason after the latest token, or (None, None) to go on (pure).

    Order: EOS (unless ignore_eos), stop_token_ids, stop strings, length.
    """
    p = seq.spec.params
    tok = seq.output_ids[-1]
    if (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids:
        return {"type": "stop", "matched": tok}, None
    if p.stop:
        # Each token decodes to at least one character for non-special tokens,
        # so the last max(len(stop)) + 2 tokens cover any stop string's end.
        window = max(len(s) for s in p.stop) + 2
        tail = decode(seq.output_ids[-window:], p.skip_special_tokens)
        for s in p.stop:
            if s in tail:
                return {"type": "stop", "matched": s}, s
    if len(seq.output_ids) >= p.max_new_tokens:
        return {"type": "length", "length": p.max_new_tokens}, None
    return None, None


@dataclass
class _Update:
    path: str
    version: str | None
    future: Future[tuple[bool, str, int]]


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
    ) -> None:
        import torch

        self.runner = runner
        self.eos = eos
        self.decode_text = decode
        self.weight_version = weight_version
        self.max_running = max_running_requests
        self._shared_gen = torch.Generator().manual_seed(random_seed)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []  # aligned with the rows of self._kv
        self._kv: kvbatch.KVBatch | None = None
        self._params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._paused = False
        self._update: _Update | None = None
        self._stop = False
        self._step_sleep = 0.0  # SGLang's /slow_down, for tests that need requests mid-flight
        self.generated_tokens = 0  # monotonic counter, read by /v1/loads
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
            raise SchedulerStopped("the engine scheduler is not running")
        seq = Seq(spec=spec, on_done=on_done, t0=time.perf_counter())
        self._commands.put(lambda: self._waiting.append(seq))

    def abort(self, rid: str | None = None, abort_all: bool = False) -> Future[int]:
        """Abort sequences whose request id (or completion id) is `rid`, or all; count them."""
        return self._call(lambda: self._abort_matching(rid, abort_all, "Abort requested"))

    def pause(self, mode: str) -> Future[None]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}")
        return self._call(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        def cmd() -> None:
            self._paused = False

        return self._call(cmd)

    def update_weights(
        self, path: str, version: str | None, abort_all: bool
    ) -> Future[tuple[bool, str, int]]:
        """Load weights when no row is decoding; resolves to (success, message, paused)."""
        fut: Future[tuple[bool, str, int]] = Future()

        def cmd() -> None:
            if self._update is not None:
                fut.set_result((False, "another weight update is in progress", 0))
                return
            if abort_all:
                self._abort_matching(None, True, "Aborted by a weight update")
            self._update = _Update(path, version, fut)

        self._commands.put(cmd)
        return fut

    def slow_down(self, seconds: float | None) -> Future[None]:
        """Sleep this long after every decode step (None/0: full speed). Testing only."""

        def cmd() -> None:
            self._step_sleep = max(0.0, seconds or 0.0)

        return self._call(cmd)

    def idle(self) -> Future[bool]:
        """True when no request is running or waiting (for /flush_cache)."""
        return self._call(lambda: not self._running and not self._waiting)

    def load(self) -> dict[str, Any]:
        """A racy but consistent-enough snapshot for /v1/loads (ints read atomically)."""
        kv = self._kv
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting),
            "num_used_tokens": int(kv.lengths.sum()) if kv is not None else 0,
            "paused": self._paused,
        }

    def _call(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()

        def cmd() -> None:
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 -- handed to the awaiting caller, who re-raises
                fut.set_exception(e)

        if not self.alive():
            fut.set_exception(SchedulerStopped("the engine scheduler is not running"))
        else:
            self._commands.put(cmd)
        return fut

    # ---- scheduler thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            self._drain_commands(block=not self._has_work())
            if self._stop:
                break
            self._maybe_update()
            try:
                if not self._paused and self._update is None and self._waiting:
                    self._admit()
                if self._running and not self._paused:
                    self._decode_step()
            except Exception as e:  # e.g. out of memory: fail these requests, keep serving
                log.exception("engine step failed; aborting the running requests")
                self._abort_matching(None, True, f"engine error: {type(e).__name__}: {e}")
                self._kv, self._params = None, None
                self.runner.invalidate()
        self._abort_matching(None, True, "Engine shutting down")

    def _has_work(self) -> bool:
        decoding = bool(self._running) and not self._paused
        admitting = bool(self._waiting) and not self._paused and self._update is None
        updating = self._update is not None and (not self._running or self._paused)
        return decoding or admitting or updating

    def _drain_commands(self, block: bool) -> None:
        if block:
            self._commands.get()()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _finish(self, seq: Seq, reason: dict[str, Any]) -> None:
        done = Completion(
            output_ids=seq.output_ids,
            logprobs=seq.logprobs,
            finish_reason=reason,
            weight_version=self.weight_version,
            e2e_latency=time.perf_counter() - seq.t0,
            matched_stop_str=seq.matched_str,
        )
        try:
            seq.on_done(done)
        except Exception:  # a broken callback must not kill the engine thread
            log.exception("completion callback of %s failed", seq.spec.out_id)

    def _abort_matching(self, rid: str | None, abort_all: bool, message: str) -> int:
        def hit(s: Seq) -> bool:
            return abort_all or s.spec.rid == rid or s.spec.out_id == rid

        reason = {"type": "abort", "message": message}
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
            self._set_rows(keep)
        return count

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort_matching(None, True, "Aborted by pause_generation")
        elif mode == "retract":
            self._waiting.extendleft(reversed(self._running))
            self._running = []
            self._kv = None
            self._params = None
            self.runner.invalidate()
        self._paused = True

    def _maybe_update(self) -> None:
        upd = self._update
        if upd is None or (self._running and not self._paused):
            return
        self._update = None
        held = len(self._running) + len(self._waiting) if self._paused else 0
        try:
            self.runner.load_weights(upd.path)
        except WeightsLoadError as e:
            log.warning("weight update refused: %s", e)
            upd.future.set_result((False, str(e), held))
            return
        except Exception as e:  # any failure must answer the caller; weights unchanged
            log.exception("weight update from %s failed", upd.path)
            upd.future.set_result((False, f"failed to load weights from {upd.path}: {e}", held))
            return
        if upd.version is not None:
            self.weight_version = upd.version
        upd.future.set_result((True, f"Succeeded to update model weights from {upd.path}.", held))

    def _set_rows(self, keep: list[int]) -> None:
        """Keep only these running rows (order preserved)."""
        self._running = [self._running[i] for i in keep]
        self._kv = kvbatch.select(self._kv, keep) if self._kv is not None else None
        self._params = None
        self.runner.invalidate()

    def _row_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch

        if self._params is None:
            ps = [s.spec.params for s in self._running]
            self._params = (
                torch.tensor([p.temperature for p in ps], dtype=torch.float32),
                torch.tensor([p.top_p for p in ps], dtype=torch.float32),
                torch.tensor([p.top_k for p in ps], dtype=torch.long),
            )
        return self._params

    def _sample(self, logits: torch.Tensor, seqs: list[Seq], params: Any) -> list[int]:
        """Sample one token per row, append token + logprob; return rows that go on."""
        temperature, top_p, top_k = params
        noise = uniform_noise(
            logits.shape[0], logits.shape[1], self._shared_gen, [s.generator for s in seqs]
        )
        tokens, logprobs = sample_rows(logits, temperature, top_p, top_k, noise)
        alive: list[int] = []
        for row, (seq, tok, lp) in enumerate(
            zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            reason, matched = stop_reason(seq, self.eos, self.decode_text)
            if reason is None:
                alive.append(row)
            else:
                seq.matched_str = matched
                self._finish(seq, reason)
        self.generated_tokens += len(seqs)
        return alive

    def _admit(self) -> None:
        import torch

        free = self.max_running - len(self._running)
        new: list[Seq] = []
        while self._waiting and len(new) < free:
            seq = self._waiting.popleft()
            if (
                seq.spec.params.max_new_tokens == 0
                or len(seq.output_ids) >= seq.spec.params.max_new_tokens
            ):
                self._finish(seq, {"type": "length", "length": seq.spec.params.max_new_tokens})
                continue
            if seq.generator is None and seq.spec.params.sampling_seed is not None:
                seq.generator = torch.Generator().manual_seed(seq.spec.params.sampling_seed)
            new.append(seq)
        if not new:
            return
        # A retracted sequence re-prefills its prompt and what it had generated.
        logits, kv = self.runner.prefill([list(s.spec.input_ids) + s.output_ids for s in new])
        ps = [s.spec.params for s in new]
        params = (
            torch.tensor([p.temperature for p in ps], dtype=torch.float32),
            torch.tensor([p.top_p for p in ps], dtype=torch.float32),
            torch.tensor([p.top_k for p in ps], dtype=torch.long),
        )
        alive = self._sample(logits, new, params)
        if not alive:
            return
        joining = kvbatch.select(kv, alive)
        assert joining is not None
        self._kv = kvbatch.join(self._kv, joining)
        self._running.extend(new[i] for i in alive)
        self._params = None
        self.runner.invalidate()

    def _decode_step(self) -> None:
        import torch

        assert self._kv is not None
        last = torch.tensor([s.output_ids[-1] for s in self._running], dtype=torch.long)
        logits = self.runner.decode(self._kv, last)
        alive = self._sample(logits, self._running, self._row_params())
        if len(alive) != len(self._running):
            self._set_rows(alive)
        if self._step_sleep:
            time.sleep(self._step_sleep)

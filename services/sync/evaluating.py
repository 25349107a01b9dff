"""Held-out evaluations on the engines: sync runs what the trainer asks for.

Why sync. An evaluation must measure one version, and sync is the one
service that knows which version each engine serves and decides when it
changes (it sends every update), so it can hold an engine on a version
until that version's evaluation ran (core.Registry.held) instead of racing
the updates. It already speaks to the engines over the SGLang API; the
trainer stays a trainer (no second model, no generation thread), and no
service calls another.

The flow: the trainer publishes `EvalRequest(v)` (`weights.evaluate`) when v
is due, before announcing v; `on_request` records it; the reconcile loop
asks the core what to start (`evals_due`) and runs one evaluation at a time
on one engine serving v (the others update as usual), through the one
evaluation function with an engine's completions (tasks/engine_eval.py: each
answer's version checked); the outcome goes out as one `EvalResult`
(`weights.evaluated`): evaluated with the figures, skipped (no engine served
v: they went past it before the request came), or aborted (an answer of
another version, an engine error, the time limit), with the reason.

What it needs is loaded at the first request, not at start-up, so a run
without evaluations costs sync nothing: the tokenizer (`[sync] model`), the
task's held-out rows and a verifier pool. A request is acknowledged once
recorded; a sync that restarts forgets the ones not yet run (the trainer
stops waiting for them at its end, saying so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from proto.messages import EvalRequest, EvalResult
from proto.subjects import Subjects
from proto.weight_version import adapter_name
from services.engine_api.engine_client import EngineClient, EngineError
from services.runtime.errors import ConfigError
from services.runtime.lifecycle import ServiceContext
from services.runtime.msgloop import Delivery
from services.runtime.publish import publish
from services.sandbox import VerifierPool
from services.sync.core import Engine, Registry
from services.sync.settings import SyncSettings
from services.tasks.engine_eval import EvalAborted, engine_complete, figures
from services.tasks.evaluate import EvalReport, evaluate
from services.tasks.scoring import Scorer, verifier_pool
from services.tasks.taskset import LoadedTask, TaskSet

log = logging.getLogger(__name__)


class Prepared:
    """What an evaluation needs, loaded once: tokenizer, held-out rows, verifier pool."""

    def __init__(self, tasks: TaskSet, loaded: dict[str, LoadedTask], tokenizer: Any,
                 pool: VerifierPool) -> None:  # fmt: skip
        self.tasks, self.loaded, self.tokenizer, self.pool = tasks, loaded, tokenizer, pool

    @classmethod
    async def load(cls, s: SyncSettings) -> Prepared:
        from services.models.resolve import resolve_model

        if s.model is None:
            raise ConfigError("[sync] model: not set (the engines' model, for the tokenizer)")
        if s.task is None and not s.tasks:
            raise ConfigError("[task]: sync was asked to evaluate, but the run file has none")
        tasks = s.task_set()
        loaded = await asyncio.to_thread(tasks.load)
        path = resolve_model(s.model, key="[sync] model")
        tokenizer = await asyncio.to_thread(_tokenizer, path)
        pool = verifier_pool(tasks, timeout_s=s.verifier_timeout_s, remote=s.sandbox_socket)
        await pool.start()
        return cls(tasks, loaded, tokenizer, pool)


def _tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class EngineEvaluations:
    """The evaluations the trainer asked for, run on the engines (module docstring)."""

    def __init__(self, ctx: ServiceContext, s: SyncSettings, reg: Registry,
                 wake: asyncio.Event) -> None:  # fmt: skip
        self.ctx, self.s, self.reg, self.wake = ctx, s, reg, wake
        self.subject = Subjects(s.run).eval_results
        self.requests: dict[int, EvalRequest] = {}
        self.done: set[int] = set()  # versions answered (a redelivered request is not re-run)
        self.prepared: Prepared | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def on_request(self, msg: EvalRequest, _d: Delivery | None) -> None:
        if msg.version in self.requests or msg.version in self.done:
            return  # a redelivery
        self.requests[msg.version] = msg
        self.reg.wanted[msg.version] = msg.requested_at or time.time()
        log.info("sync: held-out evaluation of v%d asked for", msg.version)
        self.wake.set()

    async def reconcile(self, now: float) -> None:
        """Give up what can no longer be evaluated; start the next evaluation if one is due."""
        skipped, start = self.reg.evals_due(now)
        for v in skipped:
            serving = sorted({e.version for e in self.reg.live(now)})
            why = f"no engine served v{v}: they went on to {', '.join(f'v{x}' for x in serving)}"
            await self._report(self._result(v, "skipped", why))
        if start is not None:
            version, engine = start
            task = asyncio.create_task(self._run(version, engine), name=f"evaluate-v{version}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(self, version: int, e: Engine) -> None:
        started = time.time()
        try:
            report = await asyncio.wait_for(self._evaluate(version, e), self.s.eval_timeout_s)
            result = self._result(version, "evaluated", started_at=started, engines=(e.engine_id,),
                                  report=report)  # fmt: skip
        except TimeoutError:
            why = f"not done within [sync] eval_timeout_s = {self.s.eval_timeout_s:g}s"
            result = self._result(version, "aborted", why, started_at=started)
        except (EvalAborted, EngineError, ConfigError) as err:
            result = self._result(version, "aborted", str(err), started_at=started)
        except Exception as err:  # e.g. a reward that raised: reported, not lost
            # Whatever ended it, the trainer must hear that this version has no figure (it
            # would wait for one until its end); the traceback goes to sync's log.
            log.exception("sync: held-out evaluation of v%d failed", version)
            result = self._result(version, "aborted", f"failed: {err!r}", started_at=started)
        finally:
            self.reg.evaluated(version)
            self.wake.set()  # its engine may update now
        await self._report(result)

    async def _evaluate(self, version: int, e: Engine) -> EvalReport:
        if self.prepared is None:
            self.prepared = await Prepared.load(self.s)
        p = self.prepared
        split = self.requests[version].split
        key = self.s.engine_api_key.get_secret_value() if self.s.engine_api_key else None
        async with EngineClient(e.url, retries=2, api_key=key,
                                timeout_s=self.s.eval_timeout_s) as c:  # fmt: skip
            complete = engine_complete(c, p.tokenizer, version, lora_path=self._adapter(version),
                                       concurrency=self.s.eval_concurrency)  # fmt: skip
            return await evaluate(None, p.tokenizer, p.loaded, Scorer(p.tasks, p.pool),
                                  split=split, complete=complete)  # fmt: skip

    def _adapter(self, version: int) -> str | None:
        """The adapter name to sample version `version` with, where the run's versions are
        LoRA adapters loaded by name ([sync] lora_mode 'adapter'); None: the engine's weights
        are the version (v0, the base, is never an adapter)."""
        latest = self.reg.latest
        return adapter_name(version) if version > 0 and latest and latest.adapter else None

    def _result(
        self,
        version: int,
        outcome: str,
        reason: str = "",
        *,
        started_at: float = 0.0,
        engines: tuple[str, ...] = (),
        report: EvalReport | None = None,
    ) -> EvalResult:
        req = self.requests.get(version)
        return EvalResult(
            run=self.s.run,
            version=version,
            split=req.split if req is not None else "validation",
            outcome=outcome,
            reason=reason[:2048],
            tasks=figures(report) if report is not None else (),
            engines=engines,
            requested_at=req.requested_at if req is not None else 0.0,
            started_at=started_at,
            finished_at=time.time(),
        )

    async def _report(self, r: EvalResult) -> None:
        self.requests.pop(r.version, None)
        self.done.add(r.version)
        await publish(self.ctx.js, self.subject, r, self.ctx.max_payload)
        if r.outcome == "evaluated":
            rows = max(sum(t.total for t in r.tasks), 1)
            acc = sum(t.total * t.pass_at_1 for t in r.tasks) / rows
            log.info("sync: v%d evaluated on %s in %.1fs: acc %.3f", r.version,
                     ",".join(r.engines), r.finished_at - r.started_at, acc)  # fmt: skip
        else:
            log.warning("sync: held-out evaluation of v%d %s: %s", r.version, r.outcome, r.reason)

    async def close(self) -> None:
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self.s.update_timeout_s)
        if self.prepared is not None:
            await self.prepared.pool.close()

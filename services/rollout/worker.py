"""The rollout worker: PromptTask in, one scored SampleGroup out, then ack.

Many workers share one durable pull consumer on the tasks work queue; each
keeps `concurrency` tasks in flight so its engine batches them. Per task:

1. check the engine serves at least `task.min_weight_version` — if not
   (an engine that just joined, or one being updated), the task goes back
   with a short delay for this or another worker, so no engine serves
   beyond the staleness bound;
2. tokenize (chat template), generate `n` completions with logprobs under
   a request id unique to this delivery (SGLang refuses an id still in
   flight, and a redelivered task's first generation may still be running);
   a completion aborted by a weight update is generated again, never lost;
   a 400 is the engine refusing the request itself (a bad `top_k`, a prompt
   too long): the task is dead-lettered with the engine's message, not retried;
3. score each completion with the task's environment, under a time limit;
4. publish the group (its id is deterministic, so a redelivered task's
   group is stored once) and only then let the loop ack the task.

Versions: a sample's tokens may come from several weight versions when an
update paused generation mid-way (`retract`, `in_place`). SGLang >= 0.5.19
says which tokens came from which (`weight_versions`); they become the
sample's `weight_version_spans`, its first and last version. Older engines
say only the version at completion, so the first is bounded from below by
the version the engine served when the task began.

A heartbeat loop reports the engine (id, url, version, load) for sync, and,
for the NATS weights transport, where the worker keeps weights it received
and the newest one it has (services/rollout/weights_fetch.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto.messages import (
    EngineHeartbeat,
    FinishReason,
    PromptTask,
    Sample,
    SampleGroup,
    VersionSpan,
    pack_f32,
    pack_i32,
    pack_u8,
    unpack_i32,
)
from proto.subjects import Subjects
from services.common.engine_client import (
    EngineClient,
    EngineError,
    EngineHTTPError,
    GenerateResult,
)
from services.common.errors import ConfigError, PermanentError, RetryableError
from services.common.lifecycle import ServiceContext
from services.common.msgloop import Delivery, pause, transient_errors
from services.common.publish import publish
from services.common.sglang_api import UnsupportedEngine
from services.common.tasks.prompts import encode
from services.common.tasks.sandbox import Reward
from services.rollout.settings import RolloutSettings
from services.rollout.weights_fetch import WeightsFetcher

log = logging.getLogger(__name__)


def parse_version(v: str | int | None) -> int:
    """Engine weight versions are strings in SGLang; Flywheel's are integers.

    Anything that is not a non-negative integer (SGLang's "default") is the
    initial weights, version 0.
    """
    s = str(v) if v is not None else ""
    return int(s) if s.isdigit() else 0


class Scorer(Protocol):
    """The task's prompt rendering and reward (its spec in the run file; rewards in the sandbox)."""

    def chat_template(self, task: PromptTask) -> bool: ...

    async def score(self, task: PromptTask, text: str, response_tokens: int) -> Reward: ...


def request_id(task: PromptTask, delivered: int) -> str:
    """The engine request id of one delivery of a task: never one still in flight.

    SGLang (0.5.10+) answers 400 "Duplicate request ID" to an id in flight,
    and a task can be delivered again while its first generation still runs
    (the worker that had it died, or it outlived the ack wait). The delivery
    count says which delivery it was; the random part keeps two workers apart.
    """
    return f"{task.task_id}:a{task.attempt}:d{delivered}:{uuid.uuid4().hex[:8]}"


def engine_failure(e: EngineError, url: str, task_id: str) -> PermanentError | RetryableError:
    """A 400 from /generate is the engine refusing the request itself (a bad top_k, a
    prompt too long): dead-letter it with the engine's words. Anything else may pass."""
    if isinstance(e, EngineHTTPError) and e.status == 400 and e.url.endswith("/generate"):
        return PermanentError(f"engine {url} refused task {task_id}: {e.message}",
                              reason="engine_rejected")  # fmt: skip
    return RetryableError(f"engine {url}: {e}")


def sample_versions(r: GenerateResult, before: int) -> tuple[int, int, tuple[VersionSpan, ...]]:
    """(first, last, spans) of one completion's weight versions (module docstring)."""
    spans = tuple(VersionSpan(version=parse_version(v), start=a, end=b)
                  for v, a, b in r.weight_versions)  # fmt: skip
    if spans:
        return spans[0].version, spans[-1].version, spans
    last = parse_version(r.weight_version)
    return min(before, last), last, ()


class RolloutMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.groups = Counter("flywheel_rollout_groups", "Sample groups published.", registry=r)
        self.samples = Counter(
            "flywheel_rollout_samples", "Samples generated, by finish reason.", ["finish"],
            registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "flywheel_rollout_generated_tokens", "Response tokens generated.", registry=r
        )
        self.reward = Histogram(
            "flywheel_rollout_reward", "Reward per sample.",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r,
        )  # fmt: skip
        self.verifier_errors = Counter(
            "flywheel_rollout_verifier_errors", "Verifier calls that hung or raised.", registry=r
        )
        self.aborted = Counter(
            "flywheel_rollout_aborted_generations",
            "Generations aborted by the engine (then generated again).", registry=r,
        )  # fmt: skip
        self.behind = Counter(
            "flywheel_rollout_engine_behind",
            "Tasks handed back because the engine was older than the task allows.", registry=r,
        )  # fmt: skip
        self.task_seconds = Histogram(
            "flywheel_rollout_task_seconds", "Task time from receipt to group published.",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("flywheel_rollout_tasks_in_flight", "Tasks being worked on.",
                               registry=r)  # fmt: skip
        self.engine_version = Gauge(
            "flywheel_rollout_engine_version", "Weight version of this engine.", registry=r
        )
        self.weights_downloaded = Gauge(
            "flywheel_rollout_weights_downloaded_version",
            "Newest weight version received over NATS.", registry=r,
        )  # fmt: skip
        self.weights_bytes = Counter(
            "flywheel_rollout_weights_download_bytes", "Weight bytes received over NATS.",
            registry=r,
        )  # fmt: skip
        self.weights_seconds = Histogram(
            "flywheel_rollout_weights_download_seconds", "Time to receive one weight version.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r,
        )  # fmt: skip

    def downloaded(self, version: int, size: int, seconds: float) -> None:
        self.weights_downloaded.set(version)
        self.weights_bytes.inc(size)
        self.weights_seconds.observe(seconds)


class RolloutWorker:
    def __init__(
        self,
        ctx: ServiceContext,
        s: RolloutSettings,
        client: EngineClient,
        tokenizer: Any,
        scorer: Scorer,
    ) -> None:
        self.ctx = ctx
        self.s = s
        self.client = client
        self.tok = tokenizer
        self.scorer = scorer
        self.subjects = Subjects(s.run)
        self.metrics = RolloutMetrics(ctx.registry)
        self.fetcher: WeightsFetcher | None = None  # set by the app: weights over NATS
        self.warned_errors: set[str] = set()  # verifier errors already logged once

    # tokenization
    def prompt_ids(self, task: PromptTask) -> list[int]:
        if task.prompt_ids is not None:
            return unpack_i32(task.prompt_ids).tolist()
        return encode(self.tok, task.prompt, task.messages, self.scorer.chat_template(task))

    def sampling_params(self, task: PromptTask, n: int) -> dict[str, Any]:
        sp = task.sampling
        params: dict[str, Any] = {
            "n": n,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "max_new_tokens": sp.max_new_tokens,
        }
        if sp.stop:
            params["stop"] = list(sp.stop)
        return params

    # generation
    async def engine_version(self) -> int:
        return parse_version(await self.client.weight_version())

    async def generate(self, task: PromptTask, ids: list[int], d: Delivery) -> list[GenerateResult]:
        """`task.n` finished completions; aborted ones are generated again."""
        rid = request_id(task, d.delivered)
        results = await self.client.generate(
            ids, sampling_params=self.sampling_params(task, task.n), rid=rid,
            timeout_s=self.s.generate_timeout_s,
        )  # fmt: skip
        for attempt in range(self.s.max_abort_retries + 1):
            aborted = [i for i, r in enumerate(results) if r.aborted]
            if not aborted:
                return results
            self.metrics.aborted.inc(len(aborted))
            if attempt == self.s.max_abort_retries:
                break
            await d.in_progress()
            for i in aborted:
                again = await self.client.generate(
                    ids, sampling_params=self.sampling_params(task, 1),
                    rid=f"{rid}:s{i}:r{attempt + 1}", timeout_s=self.s.generate_timeout_s,
                )  # fmt: skip
                results[i] = again[0]
        raise RetryableError(f"task {task.task_id}: generation aborted {attempt + 1} times")

    async def score(self, task: PromptTask, text: str, response_tokens: int) -> Reward:
        """The sandbox turns a hang or an exception into reward 0 with an error; counted here."""
        r = await self.scorer.score(task, text, response_tokens)
        if r.error is not None:
            self.metrics.verifier_errors.inc()
            # One warning per distinct error; repeats are counted, not logged (a broken
            # reward fails every sample: the buffer stops the run on that, not the console).
            level = logging.DEBUG if r.error in self.warned_errors else logging.WARNING
            self.warned_errors.add(r.error)
            log.log(level, "rollout: task %s: verifier failed: %s (repeats: counted in "
                    "flywheel_rollout_verifier_errors_total)", task.task_id, r.error)  # fmt: skip
        return r

    async def on_task(self, task: PromptTask, d: Delivery) -> None:
        received = time.time()
        self.metrics.in_flight.inc()
        try:
            await self._on_task(task, d, received)
        finally:
            self.metrics.in_flight.dec()

    async def _on_task(self, task: PromptTask, d: Delivery, received: float) -> None:
        try:
            before = await self.engine_version()
            if before < task.min_weight_version:
                self.metrics.behind.inc()
                raise RetryableError(
                    f"engine serves v{before}, task needs >= v{task.min_weight_version}",
                    delay_s=self.s.behind_retry_s,
                )
            try:
                ids = self.prompt_ids(task)
            except PermanentError:
                raise  # a task this worker's run file does not have (unknown_task)
            except (TypeError, ValueError) as e:
                raise PermanentError(f"cannot tokenize task {task.task_id}: {e}",
                                     reason="bad_task") from e  # fmt: skip
            started = time.time()
            results = await self.generate(task, ids, d)
        except EngineError as e:
            raise engine_failure(e, self.s.engine_url, task.task_id) from e
        group_id = f"{task.task_id}:a{task.attempt}"
        samples = []
        for i, r in enumerate(results):
            score = await self.score(task, r.text, len(r.output_ids))
            first, last, spans = sample_versions(r, before)
            samples.append(
                Sample(
                    sample_id=f"{group_id}:s{i}",
                    group_id=group_id,
                    task_id=task.task_id,
                    index=i,
                    attempt=task.attempt,
                    prompt_ids=pack_i32(ids),
                    response_ids=pack_i32(r.output_ids),
                    logprobs=pack_f32(r.logprobs),
                    loss_mask=pack_u8([1] * len(r.output_ids)),
                    reward=score.reward,
                    reward_parts=dict(score.parts),
                    finish_reason=FinishReason(r.finish_type),
                    weight_version=first,
                    weight_version_last=last,
                    weight_version_spans=spans,
                    engine_id=self.s.engine_id,
                    queued_at=task.created_at,
                    started_at=started,
                    finished_at=time.time(),
                    verifier_error=score.error,
                )
            )
            self.metrics.samples.labels(finish=r.finish_type).inc()
            self.metrics.tokens.inc(len(r.output_ids))
            self.metrics.reward.observe(score.reward)
        group = SampleGroup(
            run=self.s.run, group_id=group_id, task_id=task.task_id, env=task.env,
            worker_id=self.s.worker_id, samples=tuple(samples),
            temperature=task.sampling.temperature or 1.0, created_at=time.time(),
        )  # fmt: skip
        await publish(self.ctx.js, self.subjects.samples, group, self.ctx.max_payload)
        self.metrics.groups.inc()
        self.metrics.task_seconds.observe(time.time() - received)

    # start-up
    async def wait_for_engine(self, stop: asyncio.Event) -> None:
        """Until the engine answers which SGLang release it runs (it may still be loading).

        ConfigError, which ends the service with the cause, when the engine
        refuses the API key or runs a release outside the supported range:
        every task would fail the same way.
        """
        delay = 0.2
        while not stop.is_set():
            try:
                caps = await self.client.detect()
            except UnsupportedEngine as e:
                raise ConfigError(f"[rollout] engine_url {self.s.engine_url}: {e}") from e
            except EngineHTTPError as e:
                if e.status in (401, 403):
                    why = f"the engine at {self.s.engine_url} answered {e.status} {e.message}"
                    raise ConfigError(f"[rollout] engine_api_key: {why}") from e
                self.ctx.readiness.set("engine", f"answered {e.status}")
            except EngineError as e:
                self.ctx.readiness.set("engine", "unreachable")
                log.info("rollout: waiting for the engine at %s (%s)", self.s.engine_url, e)
            else:
                log.info("rollout: engine %s runs SGLang %s", self.s.engine_url,
                         ".".join(map(str, caps.version)))  # fmt: skip
                return
            await pause(stop, delay)
            delay = min(delay * 2, 5.0)

    # heartbeat
    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        subject = self.subjects.heartbeat(self.s.engine_id)
        transient = transient_errors()
        while not stop.is_set():
            try:
                version = await self.engine_version()
                load = await self.client.loads()
            except EngineError as e:
                # No heartbeat while the engine is down: sync then stops counting on it.
                log.warning("rollout: engine %s unreachable: %s", self.s.engine_url, e)
                self.ctx.readiness.set("engine", "unreachable")
            else:
                self.ctx.readiness.ok("engine")
                self.metrics.engine_version.set(version)
                running, queued = load.running, load.queued
                f = self.fetcher
                hb = EngineHeartbeat(
                    run=self.s.run, engine_id=self.s.engine_id, url=self.s.engine_url,
                    worker_id=self.s.worker_id, weight_version=version, running=running,
                    queued=queued, sent_at=time.time(),
                    local_weights_dir=str(f.local_dir) if f is not None else None,
                    downloaded_version=f.downloaded if f is not None else None,
                )  # fmt: skip
                try:
                    await publish(self.ctx.js, subject, hb, self.ctx.max_payload)
                except transient as e:
                    # NATS away: skip this beat. Raising here ended the loop for
                    # good, and sync then dropped a healthy engine.
                    log.warning("rollout: heartbeat not sent (%s: %s)", type(e).__name__, e)
            await pause(stop, self.s.heartbeat_s)

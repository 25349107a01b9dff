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
   a task with an episode (`[task.episode]`) runs `n` multi-turn episodes
   instead (episodes.py: turns, tool calls in the tool sandbox, observation
   tokens with loss mask 0);
3. score each completion with the task's environment, under a time limit;
   a completion whose reward could not be computed (a check that timed out,
   crashed or raised, a judge that failed, an environment's failed episode)
   travels unscored (`verifier_error`, never trained on nor in its group's
   baseline) and is dead-lettered alone with its reason (`dlq.verifier_timeout`,
   `dlq.judge_timeout`, ...): failures never pose as a reward of 0;
4. with a `[teacher]`, ask the teacher's engines for each sample's teacher
   logprobs (services/engine_api/teacher.py); a sample no teacher engine
   scores is dead-lettered alone (`teacher_failed`, the sample's bytes) and
   the group goes on without it (a task none of whose samples was scored is
   dead-lettered as a whole);
5. publish the group (its id is deterministic, so a redelivered task's
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
import json
import logging
import time
from dataclasses import replace
from typing import Any, Protocol

from proto import codec
from proto.messages import (
    EngineHeartbeat,
    PromptTask,
    Sample,
    TeacherId,
    pack_f32,
    unpack_i32,
)
from proto.subjects import Subjects
from proto.weight_version import adapter_name
from services.engine_api.engine_client import (
    EngineClient,
    EngineError,
    EngineHTTPError,
    GenerateResult,
)
from services.engine_api.sglang_api import UnsupportedEngine
from services.engine_api.teacher import TEACHER_FAILED, TeacherFailed, TeacherPool
from services.rollout.core import (
    Origin,
    adapter_made,
    engine_failure,
    make_group,
    make_sample,
    request_id,
    sampling_params,
)
from services.rollout.episodes import EpisodeRunner, as_result
from services.rollout.lending import EngineLending
from services.rollout.metrics import RolloutMetrics
from services.rollout.settings import RolloutSettings
from services.rollout.weights_fetch import WeightsFetcher
from services.runtime.errors import ConfigError, PermanentError, RetryableError
from services.runtime.lifecycle import ServiceContext
from services.runtime.msgloop import DeadLetterPublisher, Delivery, pause, transient_errors
from services.runtime.publish import publish
from services.sandbox import Reward, ToolPool
from services.tasks.episode import Episode
from services.tasks.episode_spec import EpisodeSpec
from services.tasks.judge import JUDGE_REASONS
from services.tasks.prompts import encode
from services.tasks.verifiers_v1 import V1Runner, VerifiersV1Source
from services.weights.adapter_load import adapter_versions

log = logging.getLogger(__name__)

ENV_ERROR = "env_error"  # a verifiers v1 episode that failed: the dead letter's reason


class PromptTaskScoring(Protocol):
    """A PromptTask's prompt rendering and reward (its task's spec in the run file; rewards in
    the sandbox): what the worker needs of the run's tasks (app.PromptTaskScorer)."""

    def chat_template(self, task: PromptTask) -> bool: ...

    def episode(self, task: PromptTask) -> EpisodeSpec | None: ...

    def verifiers_v1(self, task: PromptTask) -> VerifiersV1Source | None: ...

    async def score_group(
        self, task: PromptTask, completions: list[tuple[str, int]]
    ) -> list[Reward]: ...


class RolloutWorker:
    def __init__(
        self,
        ctx: ServiceContext,
        s: RolloutSettings,
        client: EngineClient,
        tokenizer: Any,
        scorer: PromptTaskScoring,
    ) -> None:
        self.ctx = ctx
        self.s = s
        self.client = client
        self.tok = tokenizer
        self.scorer = scorer
        self.subjects = Subjects(s.run)
        self.metrics = RolloutMetrics(ctx.registry)
        # the engine's busy state (its idle fraction; the core lease's, when colocated)
        self.lending = EngineLending(s.cores, s.engine_id, client, self.metrics)
        self.fetcher: WeightsFetcher | None = None  # set by the app: weights over NATS
        self.warned_errors: set[str] = set()  # verifier errors already logged once
        self.episodes: EpisodeRunner | None = None  # set by use_tools: tasks with episodes
        self.dead_letters = DeadLetterPublisher(
            ctx.js,
            run=s.run,
            service="rollout",
            max_payload=ctx.max_payload,
            registry=ctx.registry,
            subject=self.subjects.tasks,
        )
        self.teacher: TeacherPool | None = None  # set by the app: [teacher] (distillation)
        self.v1: V1Runner | None = None  # verifiers v1 envs' episodes, made on first use

    def use_tools(self, tools: ToolPool) -> None:
        """Run tasks with `[task.episode]` as episodes, their tool calls in `tools`."""
        self.episodes = EpisodeRunner(
            self.client,
            tools,
            lambda text: list(self.tok(text, add_special_tokens=False)["input_ids"]),
            self.s.generate_timeout_s,
            self.s.max_abort_retries,
            self.metrics.aborted.inc,
        )

    # tokenization
    def prompt_ids(self, task: PromptTask) -> list[int]:
        if task.prompt_ids is not None:
            return unpack_i32(task.prompt_ids).tolist()
        return encode(self.tok, task.prompt, task.messages, self.scorer.chat_template(task))

    # generation
    async def engine_version(self) -> int:
        return (await self.served())[0]

    async def served(self) -> tuple[int, str | None]:
        """The version the engine serves and, with `[rollout] lora`, the adapter to name
        as `lora_path` for it: the newest adapter Flywheel loaded there (sync unloads the
        superseded ones), else the engine's own weights (None)."""
        base = await self.client.weight_version()
        if not self.s.lora:
            return base, None
        models = await self.client.request("GET", "/v1/models")
        newest = max(adapter_versions(models), default=None)
        if newest is None or newest <= base:
            return base, None
        return newest, adapter_name(newest)

    async def generate(
        self, task: PromptTask, ids: list[int], d: Delivery, lora_path: str | None = None
    ) -> list[GenerateResult]:
        """`task.n` finished completions; aborted ones are generated again."""
        rid = request_id(task, d.delivered)
        results = await self.client.generate(
            ids,
            sampling_params=sampling_params(task, task.n),
            rid=rid,
            timeout_s=self.s.generate_timeout_s,
            lora_path=lora_path,
        )
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
                    ids,
                    sampling_params=sampling_params(task, 1),
                    rid=f"{rid}:s{i}:r{attempt + 1}",
                    timeout_s=self.s.generate_timeout_s,
                    lora_path=lora_path,
                )
                results[i] = again[0]
        raise RetryableError(f"task {task.task_id}: generation aborted {attempt + 1} times")

    async def score(self, task: PromptTask, text: str, response_tokens: int) -> Reward:
        """One completion's reward (`score_group` of one)."""
        (r,) = await self.score_group(task, [(text, response_tokens)])
        return r

    async def score_group(
        self, task: PromptTask, completions: list[tuple[str, int]]
    ) -> list[Reward]:
        """(text, response tokens) of a task's completions, scored in one sandbox round trip."""
        rewards = await self.scorer.score_group(task, completions)
        for r in rewards:
            self.count_error(task, r)
        return rewards

    def count_error(self, task: PromptTask, r: Reward) -> None:
        """The sandbox turns a hang or an exception into reward 0 with an error; counted here."""
        if r.error is not None:
            self.metrics.verifier_errors.inc()
            # One warning per distinct error; repeats are counted, not logged (a broken
            # reward fails every sample: the buffer stops the run on that, not the console).
            # A judge's failures: one warning per reason (its errors name each request).
            seen = r.reason if r.reason in JUDGE_REASONS else r.error
            level = logging.DEBUG if seen in self.warned_errors else logging.WARNING
            self.warned_errors.add(seen)
            log.log(
                level,
                "rollout: task %s: verifier failed: %s (repeats: counted in "
                "flywheel_rollout_verifier_errors_total)",
                task.task_id,
                r.error,
            )

    async def dead_letter_unscored(
        self,
        task: PromptTask,
        samples: list[Any],
        scores: list[Reward],
        results: list[GenerateResult],
        d: Delivery,
    ) -> None:
        """A sample whose reward could not be computed (a check in the sandbox that timed
        out, crashed or raised; an LLM judge that hung, failed or answered garbage; an
        environment's failed episode) goes to `dlq.<reason>` with the error and the
        completion; the sample itself travels unscored (`verifier_error`: the buffer leaves
        it out of the loss and of its group's baseline). One dead letter per sample and
        delivery-independent id, so a redelivered task's repeats are stored once."""
        for sample, score, r in zip(samples, scores, results, strict=True):
            if score.error is None:
                continue
            what = {
                "sample_id": sample.sample_id,
                "task_id": task.task_id,
                "task_name": task.task_name,
                "engine_id": self.s.engine_id,
                "error": score.error,
                "completion": r.text[:4000],
            }
            reason = score.reason or "verifier_failed"  # a Reward from elsewhere without one
            await self.dead_letters.publish(
                reason=reason,
                error=score.error,
                subject=self.subjects.tasks,
                payload=json.dumps(what).encode(),
                delivered=d.delivered,
                origin=f"rollout:{sample.sample_id}",
                where=sample.sample_id,
                expected=True,
            )

    async def run_episodes(
        self,
        task: PromptTask,
        ids: list[int],
        d: Delivery,
        spec: EpisodeSpec,
        lora_path: str | None = None,
    ) -> list[Episode]:
        if self.episodes is None:
            raise ConfigError("a task has [task.episode] but the worker has no tool sandbox")
        await d.in_progress()  # episodes take several generations
        params = sampling_params(task, 1)
        rid = request_id(task, d.delivered)
        return await self.episodes.run(spec, ids, params, rid, task.n, lora_path)

    def count_episode(self, ep: Episode, score: Reward) -> Reward:
        """The episode's figures into the metrics and the sample's reward parts."""
        self.metrics.episode_turns.observe(ep.turns)
        self.metrics.tool_calls.inc(ep.tool_calls)
        self.metrics.tool_errors.inc(ep.tool_errors)
        if ep.tool_calls:
            self.metrics.tool_seconds.observe(ep.tool_seconds / ep.tool_calls)
        for why in ep.errors:
            log.debug("rollout: tool call failed: %s", why)
        return replace(score, parts={**score.parts, **ep.parts()})

    async def on_task(self, task: PromptTask, d: Delivery) -> None:
        received = time.time()
        self.metrics.in_flight.inc()
        self.lending.started()
        try:
            await self._on_task(task, d, received)
        finally:
            self.lending.finished()
            self.metrics.in_flight.dec()

    async def _on_task(self, task: PromptTask, d: Delivery, received: float) -> None:
        try:
            before, lora = await self.served()
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
                raise PermanentError(
                    f"cannot tokenize task {task.task_id}: {e}", reason="bad_task"
                ) from e
            started = time.time()
            v1 = self.scorer.verifiers_v1(task)
            if v1 is not None:
                await self.on_v1_task(task, d, received, v1, before, lora)
                return
            episode = self.scorer.episode(task)
            episodes = await self.run_episodes(task, ids, d, episode, lora) if episode else None
            results = (
                [as_result(e, f"{task.task_id}:e{i}") for i, e in enumerate(episodes)]
                if episodes is not None
                else await self.generate(task, ids, d, lora)
            )
            if lora is not None:  # the engine reports its base's version; this is the adapter's
                results = [adapter_made(r, before) for r in results]
        except EngineError as e:
            raise engine_failure(e, self.s.engine_url, task.task_id) from e
        group_id = f"{task.task_id}:a{task.attempt}"
        samples = []
        scores = await self.score_group(task, [(r.text, len(r.output_ids)) for r in results])
        origin = Origin(self.s.engine_id, before, started)
        for i, (r, score) in enumerate(zip(results, scores, strict=True)):
            mask = None
            if episodes is not None:
                score = self.count_episode(episodes[i], score)
                mask = episodes[i].loss_mask
            samples.append(make_sample(task, group_id, i, ids, r, score, origin, mask))
            self.metrics.samples.labels(finish=r.finish_type).inc()
            self.metrics.tokens.inc(len(r.output_ids))
            if score.error is None:  # a failed check's 0 is no reward (never trained on)
                self.metrics.reward.observe(score.reward)
        await self.dead_letter_unscored(task, samples, scores, results, d)
        if self.teacher is not None:
            await d.in_progress()  # scoring adds a request per sample
            samples = await self.with_teacher(self.teacher, task, samples)
        group = make_group(self.s.run, task, group_id, tuple(samples), self.s.worker_id)
        await publish(self.ctx.js, self.subjects.samples, group, self.ctx.max_payload)
        self.metrics.groups.inc()
        self.metrics.task_seconds.observe(time.time() - received)

    # distillation
    async def with_teacher(
        self, pool: TeacherPool, task: PromptTask, samples: list[Sample]
    ) -> list[Sample]:
        """The samples with their teacher logprobs; one the teacher could not score is
        dead-lettered (`teacher_failed`) and left out. PermanentError if none is left."""
        scored = await asyncio.gather(*(self._teach(pool, s) for s in samples))
        kept = [s for s in scored if s is not None]
        if not kept:
            raise PermanentError(
                f"task {task.task_id}: the teacher scored none of its {len(samples)} samples",
                reason=TEACHER_FAILED,
            )
        return kept

    async def _teach(self, pool: TeacherPool, s: Sample) -> Sample | None:
        t0 = time.perf_counter()
        try:
            got = await pool.score(
                unpack_i32(s.prompt_ids).tolist(), unpack_i32(s.response_ids).tolist()
            )
        except TeacherFailed as e:
            self.metrics.teacher_failures.inc()
            if self.dead_letters is not None:
                await self.dead_letters.publish(
                    reason=e.reason,
                    error=str(e),
                    subject=self.subjects.samples,
                    payload=codec.encode(s, None),
                    delivered=0,
                    origin=f"teacher:{s.sample_id}",
                    where=s.sample_id,
                )
            return None
        self.metrics.teacher_seconds.observe(time.perf_counter() - t0)
        who = TeacherId(name=pool.s.name, model=got.model, version=got.version)
        return s.model_copy(update={"teacher_logprobs": pack_f32(got.logprobs), "teacher": who})

    async def on_v1_task(
        self,
        task: PromptTask,
        d: Delivery,
        received: float,
        src: VerifiersV1Source,
        before: int,
        lora: str | None,
    ) -> None:
        """A verifiers v1 task: its env runs `n` episodes through the engine's /v1 chat
        route and scores them (services/tasks/verifiers_v1.py); each is one sample."""
        if lora is not None:
            raise ConfigError("verifiers-v1 tasks do not run on LoRA adapters yet")
        if self.v1 is None:
            key = self.s.engine_api_key
            self.v1 = V1Runner(
                self.s.engine_url,
                str(self.s.model),
                self.s.generate_timeout_s,
                self.s.max_abort_retries,
                self.metrics.aborted.inc,
                key.get_secret_value() if key else None,
            )
        await d.in_progress()  # episodes take several generations
        started = time.time()
        try:
            out = await self.v1.run(src, task.index, task.n, sampling_params(task, 1))
        except EngineError as e:
            raise engine_failure(e, self.s.engine_url, task.task_id) from e
        group_id = f"{task.task_id}:a{task.attempt}"
        origin = Origin(self.s.engine_id, before, started)
        samples, scores, results = [], [], []
        for i, v in enumerate(out):
            r = as_result(v.episode, f"{task.task_id}:e{i}")
            score = Reward(v.reward, v.parts, v.error, ENV_ERROR if v.error else None)
            self.count_error(task, score)
            scores.append(score)
            results.append(r)
            ep = v.episode
            samples.append(
                make_sample(task, group_id, i, ep.prompt_ids, r, score, origin, ep.loss_mask)
            )
            self.metrics.samples.labels(finish=r.finish_type).inc()
            self.metrics.tokens.inc(sum(v.episode.loss_mask))
            self.metrics.episode_turns.observe(v.episode.turns)
            if score.error is None:
                self.metrics.reward.observe(score.reward)
        await self.dead_letter_unscored(task, samples, scores, results, d)
        group = make_group(self.s.run, task, group_id, tuple(samples), self.s.worker_id)
        await publish(self.ctx.js, self.subjects.samples, group, self.ctx.max_payload)
        self.metrics.groups.inc()
        self.metrics.task_seconds.observe(time.time() - received)

    async def close(self) -> None:
        """What the worker opened itself (the v1 runner's env servers)."""
        if self.v1 is not None:
            await self.v1.aclose()
            self.v1 = None

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
                log.info(
                    "rollout: engine %s runs SGLang %s",
                    self.s.engine_url,
                    ".".join(map(str, caps.version)),
                )
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
                    run=self.s.run,
                    engine_id=self.s.engine_id,
                    url=self.s.engine_url,
                    worker_id=self.s.worker_id,
                    weight_version=version,
                    running=running,
                    queued=queued,
                    sent_at=time.time(),
                    local_weights_dir=str(f.local_dir) if f is not None else None,
                    downloaded_version=f.downloaded if f is not None else None,
                )
                try:
                    await publish(self.ctx.js, subject, hb, self.ctx.max_payload)
                except transient as e:
                    # NATS away: skip this beat. Raising here ended the loop for
                    # good, and sync then dropped a healthy engine.
                    log.warning("rollout: heartbeat not sent (%s: %s)", type(e).__name__, e)
            await pause(stop, self.s.heartbeat_s)

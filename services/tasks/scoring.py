"""Score a completion of a named task in the verifier sandbox: rollout and evaluation alike.

`Scorer` turns (task name, row, completion) into one `pool.call` of
`rewards.score` with that task's reward parts, so a reward runs in the
killable sandbox under the pool's time limit whether a rollout worker or
the evaluation asks, and answers the same. `verifier_pool` and `tool_pool`
build the pools a run's tasks need, with what their sandboxes must show
(the user's modules) and whether a host without one may run them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from services.runtime.errors import PermanentError
from services.sandbox import Limits, Reward, Sandbox, ToolPool, VerifierPool, tool_modules
from services.tasks import rewards
from services.tasks import tools as _tools  # noqa: F401 -- declares its entry point to the pools
from services.tasks.episode_spec import FunctionTool, PythonTool
from services.tasks.judge import Judge, JudgeReward, with_verdicts
from services.tasks.registry import SourceSpec, as_fields
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet


class UnknownTask(PermanentError):
    """A PromptTask names a task this service's run file does not have."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(
            f"task {name!r} is not in this run file's task spec (it has {known}): "
            "buffer and rollout read different run files?",
            reason="unknown_task",
        )


def reward_payload(spec: TaskSpec) -> list[dict[str, Any]]:
    """The task's sandboxed reward parts as plain fields, for the sandbox child
    (registry.as_fields); parts scored outside it (a judge) are not sent."""
    return [as_fields(p) for p in spec.reward if not p.external]


def judge_parts(spec: TaskSpec) -> list[JudgeReward]:
    """The task's parts an LLM judge scores (outside the sandbox)."""
    return [p for p in spec.reward if isinstance(p, JudgeReward)]


class Scorer:
    """Rewards of a run's tasks: parts in `pool` (the sandbox), judge parts by `judge`.

    Without a judge (the held-out evaluation), judge parts are left out of
    the sum: evaluation measures the verifiable parts (`eval.part`).
    """

    def __init__(
        self,
        tasks: TaskSet,
        pool: VerifierPool,
        tools: ToolPool | None = None,
        judge: Judge | None = None,
    ) -> None:
        self.tasks = tasks
        self.pool = pool
        self.tools = tools  # where episodes' tool calls run (tasks with [task.episode])
        self.judge = judge
        self._parts = {n: reward_payload(s) for n, s in tasks.specs.items()}
        self._judged = {n: judge_parts(s) for n, s in tasks.specs.items()}

    def spec(self, name: str) -> TaskSpec:
        spec = self.tasks.spec(name)
        if spec is None:
            raise UnknownTask(name, self.tasks.names)
        return spec

    def chat_template(self, name: str) -> bool:
        return self.spec(name).chat_template

    async def score(
        self,
        name: str,
        row: int,
        completion: str,
        answer: str | None,
        response_tokens: int,
        *,
        split: str = "train",
    ) -> Reward:
        """Score one completion of row `row` of `split`'s source (train: the task's)."""
        (r,) = await self.score_group(name, row, answer, [(completion, response_tokens)], split)
        return r

    async def score_group(
        self,
        name: str,
        row: int,
        answer: str | None,
        completions: Sequence[tuple[str, int]],
        split: str = "train",
        prompt: str = "",
    ) -> list[Reward]:
        """Score (completion, response tokens) pairs of row `row` in one sandbox round trip
        (`VerifierPool.call_many`): the same rewards as one `score` each. Judge parts, if
        the task has any and this scorer a judge, are asked at the same time (`prompt`:
        the prompt as the policy saw it, for the rubric's {prompt})."""
        judged = self._judged.get(name, []) if self.judge is not None else []
        if not judged:
            return await self._sandboxed(name, row, answer, completions, split)
        assert self.judge is not None
        texts = [c for c, _ in completions]
        rewards, verdicts = await asyncio.gather(
            self._sandboxed(name, row, answer, completions, split),
            self.judge.verdicts(judged, prompt, texts, answer),
        )
        return [with_verdicts(r, judged, v) for r, v in zip(rewards, verdicts, strict=True)]

    async def _sandboxed(
        self,
        name: str,
        row: int,
        answer: str | None,
        completions: Sequence[tuple[str, int]],
        split: str,
    ) -> list[Reward]:
        spec = self.spec(name)
        if not self._parts[name]:  # judge parts only: nothing for the sandbox
            return [Reward(0.0) for _ in completions]
        source = source_of(spec, split)
        src = source.scorer_context()  # a source's own scorer needs the source
        calls = []
        for completion, response_tokens in completions:
            ctx: dict[str, Any] = {"row": row, "response_tokens": response_tokens}
            if src is not None:
                ctx["source"] = src
            calls.append((self._parts[name], completion, answer, ctx))
        return await self.pool.call_many(rewards.SCORE, calls)


def source_of(spec: TaskSpec, split: str) -> SourceSpec:
    """Where rows of `split` come from: the held-out split's own source, or the task's."""
    if split == "validation" and spec.eval.source is not None:
        return spec.eval.source
    if split == "test" and spec.eval.test_source is not None:
        return spec.eval.test_source
    return spec.source


def warmup(tasks: TaskSet) -> list[tuple[str, tuple[Any, ...]]]:
    """The pool's warm-up calls for these tasks (every source of each: training and eval)."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    for spec in tasks.specs.values():
        for source in {id(s): s for s in (spec.source, *spec.eval.sources)}.values():
            src = source.scorer_context()
            ctx = {"source": src} if src is not None else {}
            # the parts without their `env`: a reward's secret reaches only its own calls
            parts = [{k: v for k, v in p.items() if k != "env"} for p in reward_payload(spec)]
            calls.append((rewards.WARM, (parts, ctx)))
    return calls


def tool_pool(tasks: TaskSet, remote: str | os.PathLike[str] | None = None) -> ToolPool | None:
    """The tool sandbox the run's episodes need (None: no task has one), not yet started:
    sized and limited by the largest ask among its tasks; `remote`: a sandbox server's
    socket (VerifierPool)."""
    episodes = [s.episode for s in tasks.specs.values() if s.episode is not None]
    if not episodes:
        return None
    tools = [t.model_dump(mode="json") for e in episodes for t in e.tools]
    return ToolPool(
        size=max(e.tool_processes for e in episodes),
        timeout_s=max(e.tool_timeout_s for e in episodes),
        memory_mb=max(e.tool_memory_mb for e in episodes),
        tools=tools,
        sandbox=Sandbox(modules=tool_modules(tools), required_by=_required(tasks, _runs_tool_code)),
        remote=remote,
    )


# ── which code needs the sandbox ─────────────────────────────────────────────
# Built-in rewards and the calculator are Flywheel's code reading the policy's
# text; a custom reward, a verifiers rubric, a function tool or the python tool
# is code Flywheel does not know, or runs the policy's text as code. Where the
# host has no sandbox, only the former run (as plain processes) unless the task
# says sandbox = "insecure-allow".
def _runs_reward_code(spec: TaskSpec) -> bool:
    return any(p.runs_code for p in spec.reward)


def _runs_tool_code(spec: TaskSpec) -> bool:
    tools = spec.episode.tools if spec.episode is not None else ()
    return any(isinstance(t, PythonTool | FunctionTool) for t in tools)


def _required(tasks: TaskSet, runs_code: Any) -> tuple[str, ...]:
    """The tables whose code may not run without the sandbox."""
    return tuple(
        tasks.keys[n] for n, s in tasks.specs.items() if runs_code(s) and s.sandbox == "required"
    )


def reward_modules(tasks: TaskSet) -> tuple[str, ...]:
    """The modules the tasks' rewards import (their top-level packages are visible in the
    verifier sandbox; Flywheel's own always are)."""
    mods: list[str] = []
    for spec in tasks.specs.values():
        mods += [m for p in spec.reward for m in p.sandbox_modules()]
        for src in (spec.source, *spec.eval.sources):
            mods += src.sandbox_modules()
    return tuple(dict.fromkeys(mods))


def verifier_sandbox(tasks: TaskSet, limits: Limits | None = None) -> Sandbox:
    """The verifier pool's sandbox for these tasks: their reward modules visible, required
    unless every task with reward code allows running it without."""
    return Sandbox(
        modules=reward_modules(tasks),
        limits=limits or Limits(),
        required_by=_required(tasks, _runs_reward_code),
    )


def verifier_pool(
    tasks: TaskSet,
    size: int = 2,
    timeout_s: float = 5.0,
    remote: str | os.PathLike[str] | None = None,
) -> VerifierPool:
    """The pool that scores these tasks (warm-up, sandbox), not yet started; `remote`: a
    sandbox server's socket (VerifierPool)."""
    return VerifierPool(
        size, timeout_s, warmup=warmup(tasks), sandbox=verifier_sandbox(tasks), remote=remote
    )


def correct(spec: TaskSpec, r: Reward) -> bool:
    """Whether a scored completion counts as correct (eval.part >= eval.threshold)."""
    return r.error is None and r.parts.get(spec.correct_part, r.reward) >= spec.eval.threshold

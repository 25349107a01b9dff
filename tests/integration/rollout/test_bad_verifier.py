"""A reward that hangs or raises: the sample scores 0, carries the error, and is counted.

Real verifier sandbox processes (services/sandbox/pool.py), a task
whose reward is a custom function by import path, and the rollout worker's
own scoring step (`RolloutWorker.score`, which sets the sample's
`verifier_error` from the result and counts
`flywheel_rollout_verifier_errors_total`). A good reward still scores
afterwards: the hung child was replaced.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from proto.messages import PromptTask, SamplingParams
from services.rollout.app import PromptTaskScorer
from services.rollout.metrics import RolloutMetrics
from services.rollout.worker import RolloutWorker
from services.sandbox import Reward, VerifierPool
from services.tasks.scoring import Scorer
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet
from tests.harness.sandbox import TESTS

MODULE = "tests.integration.rollout.bad_verifiers"


@dataclass
class Ctx:
    """The one thing RolloutWorker.score needs from a service context: its registry."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)


def errors_total(registry: CollectorRegistry) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("flywheel_rollout_verifier_errors_total "):
            return float(line.split()[1])
    raise AssertionError("flywheel_rollout_verifier_errors_total not exported")


def test_hanging_and_raising_verifiers_score_zero_and_are_counted() -> None:
    task = PromptTask(
        run="v", task_id="v:e0:i0", epoch=0, index=0, task_name="arithmetic", prompt="1+2=",
        answer="3", n=1, sampling=SamplingParams(), created_at=time.time(),
    )  # fmt: skip

    def tasks(reward: str) -> TaskSet:
        spec = TaskSpec.model_validate({"source": {"type": "arithmetic"}, "reward": reward})
        return TaskSet({"arithmetic": spec}, {"arithmetic": "[task]"})

    async def body() -> tuple[list[Reward], float, float]:
        async with VerifierPool(size=1, timeout_s=1.0, sandbox=TESTS) as pool:
            ctx: Any = Ctx()
            metrics = RolloutMetrics(ctx.registry)
            results = []
            for reward in (f"{MODULE}:hangs", f"{MODULE}:raises", "exact_match"):
                worker = RolloutWorker.__new__(RolloutWorker)  # only the scoring step
                worker.metrics = metrics
                worker.warned_errors = set()
                worker.scorer = PromptTaskScorer(Scorer(tasks(reward), pool))
                t0 = time.monotonic()
                results.append(await worker.score(task, "3", 1))
                if reward.endswith("hangs"):
                    assert time.monotonic() - t0 < 10  # bounded by the pool's limit
            return results, errors_total(ctx.registry), float(sum(pool.errors.values()))

    (hung, raised, good), counted, pool_errors = asyncio.run(body())
    assert hung.reward == 0.0 and hung.error and "timed out" in hung.error, hung
    assert raised.reward == 0.0 and raised.error and "ValueError" in raised.error, raised
    assert good.reward == 1.0 and good.error is None, good  # the hung child was replaced
    # each failure says why, as the dead-letter reason the worker files it under
    reasons = (hung.reason, raised.reason, good.reason)
    assert reasons == ("verifier_timeout", "verifier_raised", None), reasons
    assert counted == 2.0 and pool_errors == 2.0

"""The trainer's `eval_every`: the task's validation split, and the reward parts it logs.

Validation, never test: these evaluations choose the best checkpoint
(best.py) and stop a run on its target, so the figures reported on test
(`flywheel eval`, the demo) were not picked for.

The rows are loaded once at start-up (a missing split is a ConfigError
then, not at the first evaluation); each evaluation loads the published
weights directory and runs the one evaluation function
(services/tasks/evaluate.py) with a verifier pool of the trainer's.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from proto.messages import TrainBatch
from services.runtime.errors import ConfigError
from services.runtime.threads import niced_pool, offload_to
from services.sandbox import ToolPool, VerifierPool
from services.tasks.evaluate import (
    EvalReport,
    add_pass_at_k,
    evaluate,
    hf_complete,
    load_model,
    samples_k,
)
from services.tasks.scoring import Scorer, tool_pool, verifier_pool
from services.trainer.settings import TrainerSettings


class HeldOut:
    """Evaluation on the held-out split; use as `async with HeldOut(settings) as h`."""

    def __init__(self, s: TrainerSettings) -> None:
        self.enabled = bool(s.eval_every)
        # eval_on = "engines": the split is checked and loaded here all the same (a missing
        # one fails at start-up), but nothing generates or scores in this process
        self.here = self.enabled and s.eval_on == "trainer"
        self.tasks = s.task_set()
        self.loaded = self.tasks.load() if self.enabled else {}
        if self.enabled and not any(t.validation for t in self.loaded.values()):
            raise ConfigError(
                f"[task] eval: [trainer] eval_every = {s.eval_every} needs a held-out split: "
                "set eval.holdout = 0.1 (a fraction of the source) or eval.source (a test file)"
            )
        if self.enabled and s.eval_on == "engines":
            for name, t in self.loaded.items():
                if t.spec.episode is not None:
                    raise ConfigError(
                        f"[trainer] eval_on = 'engines': task {name!r} has [task.episode], "
                        "whose held-out episodes run with a model of the evaluating process: "
                        "set eval_on = 'trainer'"
                    )
        # whether an evaluation draws pass@k samples after its pass@1 (a task with eval.k > 1)
        self.draws_samples = any(
            samples_k(t) for t in self.loaded.values() if t.held_out("validation")
        )
        # the samples yield the cores to the steps (a lower priority than the greedy pass's,
        # which runs at the training's): the eval budget counts the greedy pass alone
        self.samples_yield = s.eval_nice > s.eval_greedy_nice
        self.remote = s.sandbox_socket
        self.loaded_models: Any = None  # a counter of model copies loaded (the trainer's metric)
        # the model load and greedy pass: a thread at eval_greedy_nice; the pass@k samples:
        # one at eval_nice; never the training step's
        self.greedy_cpu = niced_pool(s.eval_greedy_nice, "heldout-greedy")
        self.greedy_offload = offload_to(self.greedy_cpu)
        self.cpu = niced_pool(s.eval_nice, "heldout")
        self.offload = offload_to(self.cpu)
        self.pool: VerifierPool | None = None
        self.tools: ToolPool | None = None  # tasks with episodes: their tools' sandbox

    async def __aenter__(self) -> HeldOut:
        if self.here:
            self.pool = verifier_pool(self.tasks, remote=self.remote)
            await self.pool.start()
            self.tools = tool_pool(self.tasks, self.remote)
            if self.tools is not None:
                await self.tools.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.tools is not None:
            await self.tools.close()
        for pool in (self.greedy_cpu, self.cpu):
            pool.shutdown(wait=False)  # an evaluation cancelled mid-generate ends alone

    async def run(
        self,
        path: Path,
        pass_at_1: Callable[[EvalReport], Awaitable[None]],
        halt: threading.Event | None = None,
    ) -> EvalReport:
        """Evaluate the weights at `path`: greedy pass@1 first, handed to `pass_at_1` the
        moment it is known (it is the figure that chooses the best weights and meets a run's
        target), then the pass@k samples of the tasks that draw them (k x as many
        generations: a user would otherwise learn the figure that matters that much later).
        `halt`, once set, ends a generation in flight at its next token: it raises `Halted`
        (services/tasks/evaluate.py)."""
        assert self.pool is not None, "HeldOut used outside `async with` or with eval_every = 0"
        model, tok = await self.greedy_offload(load_model, path)
        if self.loaded_models is not None:
            self.loaded_models.inc()
        scorer = Scorer(self.tasks, self.pool, self.tools)
        report = await evaluate(
            model, tok, self.loaded, scorer, split="validation", greedy_only=True,
            offload=self.greedy_offload,
            complete=hf_complete(model, tok, self.greedy_offload, halt=halt),
        )  # fmt: skip
        await pass_at_1(report)
        if not self.draws_samples:
            return report
        samples = hf_complete(model, tok, self.offload, halt=halt)
        return await add_pass_at_k(tok, self.loaded, scorer, report, samples)


def reward_parts(batch: TrainBatch) -> dict[str, float]:
    """Mean of each reward part over the batch's samples that have it: `reward/<part>`."""
    sums: dict[str, list[float]] = defaultdict(list)
    for g in batch.groups:
        for s in g.samples:
            for name, v in s.reward_parts.items():
                sums[name].append(v)
    return {f"reward/{k}": sum(v) / len(v) for k, v in sorted(sums.items())}


def eval_line(row: dict[str, Any]) -> str:
    """' acc 0.620 pass@4 0.810' for the trainer's log line, '' without an evaluation."""
    if "eval_accuracy" not in row:
        return ""
    k = f" pass@k {row['eval_pass_at_k']:.3f}" if "eval_pass_at_k" in row else ""
    return f" acc {row['eval_accuracy']:.3f}{k}"

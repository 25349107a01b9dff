"""The trainer's held-out evaluation loads and generates on threads of its own, the greedy
pass at `eval_greedy_nice` and the pass@k samples at `eval_nice` (services/trainer/
heldout.py): same figures as an evaluation at the caller's priority, the work on threads the
kernel reports at those nice values, the event loop's thread untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.runtime.threads import thread_nice
from services.tasks.evaluate import EvalReport, TaskEval, evaluate_dir
from services.trainer.heldout import HeldOut
from services.trainer.settings import TrainerSettings

TASK = {
    "source": {"type": "arithmetic"},
    "eval": {"source": {"type": "arithmetic", "seed": 1}, "size": 8, "max_new_tokens": 4},
}


@pytest.mark.parametrize(("nice", "greedy_nice"), [(19, 0), (0, 19)])
def test_heldout_generates_on_threads_at_eval_nice_and_eval_greedy_nice(
    tiny_model_dir: Path, nice: int, greedy_nice: int
) -> None:
    s = TrainerSettings(run="heldout-nice", task=TASK, eval_every=1, eval_nice=nice,
                        eval_greedy_nice=greedy_nice, eval_on="trainer")  # fmt: skip
    caller = thread_nice()

    async def body() -> tuple[TaskEval, int, int, int]:
        async with HeldOut(s) as h:
            (task,) = (await h.run(tiny_model_dir, ignore)).tasks.values()
            niced = await h.offload(thread_nice), await h.greedy_offload(thread_nice)
            return task, *niced, thread_nice()

    got, worker, greedy_worker, loop_thread = asyncio.run(body())
    assert worker == max(nice, caller) and greedy_worker == max(greedy_nice, caller)
    assert loop_thread == caller
    (plain,) = evaluate_dir(tiny_model_dir, s.task_set(), split="validation").tasks.values()
    # greedy, so the same completions and figures: the priority changes the timing only
    assert (got.total, got.pass_at_1, got.examples) == (
        plain.total,
        plain.pass_at_1,
        plain.examples,
    )
    assert got.total == 8 and got.examples


async def ignore(report: EvalReport) -> None:
    return None


def test_pass_at_1_is_known_before_the_samples_are_drawn(tiny_model_dir: Path) -> None:
    """A task with eval.k > 1: `run` hands over the greedy figures (no pass@k yet) before
    it draws the k samples, and ends with the figures of one whole evaluation."""
    task = {**TASK, "eval": {**TASK["eval"], "k": 3, "temperature": 1.0}}
    s = TrainerSettings(run="heldout-k", task=task, eval_every=1, eval_on="trainer")
    seen: list[EvalReport] = []

    async def first(report: EvalReport) -> None:
        seen.append(report)

    async def body() -> EvalReport:
        async with HeldOut(s) as h:
            return await h.run(tiny_model_dir, first)

    final = asyncio.run(body())
    (greedy,) = seen
    assert greedy.pass_at_k is None and greedy.k == 1
    assert "eval_pass_at_k" not in greedy.metrics()
    assert final.k == 3 and final.pass_at_k is not None
    whole = evaluate_dir(tiny_model_dir, s.task_set(), split="validation")
    assert (final.pass_at_1, final.pass_at_k) == (whole.pass_at_1, whole.pass_at_k)
    assert greedy.pass_at_1 == whole.pass_at_1
    assert final.pass_at_k_metrics() == {"eval_pass_at_k": whole.pass_at_k}

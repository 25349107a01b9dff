"""The trainer's held-out evaluation loads and generates on its own thread at `eval_nice`
(services/trainer/heldout.py): same figures as an evaluation at the caller's priority,
the work on a thread the kernel reports at nice 19, the event loop's thread untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.runtime.threads import thread_nice
from services.tasks.evaluate import TaskEval, evaluate_dir
from services.trainer.heldout import HeldOut
from services.trainer.settings import TrainerSettings

TASK = {
    "source": {"type": "arithmetic"},
    "eval": {"source": {"type": "arithmetic", "seed": 1}, "size": 8, "max_new_tokens": 4},
}


@pytest.mark.parametrize("nice", [19, 0])
def test_heldout_generates_on_a_thread_at_eval_nice(tiny_model_dir: Path, nice: int) -> None:
    s = TrainerSettings(
        run="heldout-nice", task=TASK, eval_every=1, eval_nice=nice, eval_on="trainer"
    )
    caller = thread_nice()

    async def body() -> tuple[TaskEval, int, int]:
        async with HeldOut(s) as h:
            (task,) = (await h.run(tiny_model_dir)).tasks.values()
            return task, await h.offload(thread_nice), thread_nice()

    got, worker, loop_thread = asyncio.run(body())
    assert worker == max(nice, caller)
    assert loop_thread == caller
    (plain,) = evaluate_dir(tiny_model_dir, s.task_set(), split="validation").tasks.values()
    # greedy, so the same completions and figures: the priority changes the timing only
    assert (got.total, got.pass_at_1, got.examples) == (
        plain.total,
        plain.pass_at_1,
        plain.examples,
    )
    assert got.total == 8 and got.examples

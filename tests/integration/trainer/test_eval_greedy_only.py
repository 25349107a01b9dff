"""`greedy_only`: the demo's test figure skips a run file's pass@k samples, and pass@1 is
the same figure either way (services/tasks/evaluate.py, services/stack/demo.py)."""

from __future__ import annotations

from services.tasks.arithmetic import ArithmeticSource
from services.tasks.evaluate import evaluate_dir
from services.tasks.spec import EvalSpec, TaskSpec
from services.tasks.taskset import TaskSet


def test_greedy_only_reports_pass_at_1_without_the_k_samples(tiny_model_dir) -> None:
    spec = TaskSpec(
        source=ArithmeticSource(type="arithmetic"),
        eval=EvalSpec(
            source=ArithmeticSource(type="arithmetic", seed=1), size=12, max_new_tokens=4, k=3
        ),
    )
    tasks = TaskSet({"arithmetic": spec}, {"arithmetic": "[task]"})
    full = evaluate_dir(tiny_model_dir, tasks).tasks["arithmetic"]
    greedy = evaluate_dir(tiny_model_dir, tasks, greedy_only=True).tasks["arithmetic"]
    assert full.k == 3 and full.pass_at_k is not None
    assert greedy.pass_at_k is None and greedy.k == 1
    assert (greedy.total, greedy.pass_at_1, greedy.mean_reward) == (
        full.total, full.pass_at_1, full.mean_reward)  # fmt: skip
    assert greedy.examples == full.examples

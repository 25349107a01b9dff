"""The weights `flywheel demo` hands over (services/stack/demo.py `best_weights`): the
best on validation among the trainer's evaluations and the last version, which a run
stopped on its time or target ends without evaluating (the demo evaluates it then)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.stack.demo import best_weights
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet

# every completion right: the last weights read validation accuracy 1.0 whatever they say
TASK = {
    "source": {"type": "arithmetic"},
    "reward": {"fn": "format", "pattern": ".*"},
    "eval": {"holdout": 0.2, "size": 6, "max_new_tokens": 2},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelSpec())


def run_dir(tmp: Path, model: Path, best: float | None, evaluated: list[int]) -> Path:
    """checkpoints/best.json of v5 at `best` (None: no evaluation kept), the last version
    v9, and the trainer's evaluation rows of the `evaluated` versions."""
    (tmp / "checkpoints").mkdir(parents=True)
    if best is not None:
        shutil.copytree(model, tmp / "checkpoints" / "best")
        record = {"step": 5, "accuracy": best, "weights": str(tmp / "checkpoints" / "best")}
        (tmp / "checkpoints" / "best.json").write_text(json.dumps(record))
    rows = [{"step": s, "eval_accuracy": 0.5} for s in evaluated]
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def tasks() -> TaskSet:
    return TaskSet({"t": TaskSpec.model_validate(TASK)}, {"t": "[task]"})


@pytest.mark.parametrize(
    ("best", "evaluated", "want"),
    [
        (0.5, [0, 5], 9),  # the last, never evaluated, reads 1.0 > 0.5: handed over
        (1.0, [0, 5], 5),  # a tie keeps the older, as the trainer's choice does
        (None, [0], 9),  # nothing trained was evaluated: the last
        (0.5, [0, 5, 9], 5),  # the trainer evaluated the last itself: its choice stands
    ],
)
def test_the_demo_hands_over_the_best_of_the_evaluated_and_the_last(
    tmp_path: Path, model: Path, best: float | None, evaluated: list[int], want: int
) -> None:
    d = run_dir(tmp_path, model, best, evaluated)
    weights, step = best_weights(d, model, 9, tasks())
    assert step == want
    assert weights == (model if want == 9 else d / "checkpoints" / "best")

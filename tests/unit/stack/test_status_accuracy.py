"""No figure before it is measured (services/stack/status.py): the status line reads the
trainer's real metrics (services/trainer/metrics.py) and shows "acc none yet" until a
held-out evaluation has ended, then the figure with the version it measured and its age,
and the due evaluations that were not run."""

from __future__ import annotations

import math
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from services.stack.status import Status, accuracy_text, ago, parse, render_line, summarise
from services.tasks.evaluate import EvalReport, TaskEval
from services.trainer.metrics import Recorder
from services.trainer.settings import TrainerSettings


def recorder(tmp_path: Path) -> tuple[Recorder, CollectorRegistry]:
    s = TrainerSettings(
        run="acc", task={"source": {"type": "arithmetic"}}, metrics_file=tmp_path / "m.jsonl"
    )
    registry = CollectorRegistry()
    return Recorder(registry, s), registry


def scraped(registry: CollectorRegistry) -> Status:
    return summarise({"trainer": parse(generate_latest(registry).decode())})


def test_before_any_evaluation_the_gauges_say_not_measured_and_the_line_none_yet(
    tmp_path: Path,
) -> None:
    rec, registry = recorder(tmp_path)
    assert math.isnan(registry.get_sample_value("flywheel_trainer_eval_accuracy") or 0.0)
    assert registry.get_sample_value("flywheel_trainer_eval_version") == -1
    now = scraped(registry)
    rec.close()
    assert now.accuracy is None and now.eval_version is None
    line = render_line(now, None)
    assert "| acc none yet |" in line and "0.000" not in line


def test_an_evaluation_shows_its_figure_version_and_age(tmp_path: Path) -> None:
    rec, registry = recorder(tmp_path)
    report = EvalReport({"t": TaskEval(total=10, pass_at_1=0.62, mean_reward=0.7)})
    rec.evaluated(report, {"step": 10})
    rec.close()
    now = scraped(registry)
    assert (now.accuracy, now.eval_version) == (0.62, 10)
    assert now.eval_at is not None and abs(now.at - now.eval_at) < 5
    later = Status(step=30, accuracy=0.62, eval_version=10, eval_at=now.at, at=now.at + 40)
    assert accuracy_text(later) == "acc 0.620 (v10, 40 s ago)"
    # a measured 0 is a figure: shown, with the version that says it is the start's
    zero = Status(step=12, accuracy=0.0, eval_version=0, eval_at=now.at, at=now.at + 420)
    assert "| acc 0.000 (v0, 7 min ago) |" in render_line(zero, None)


def test_due_evaluations_not_run_are_counted_beside_the_figure(tmp_path: Path) -> None:
    rec, registry = recorder(tmp_path)
    rec.metrics.evals_deferred.inc(2)
    rec.close()
    now = scraped(registry)
    assert now.evals_not_run == (0, 2)
    assert accuracy_text(now) == "acc none yet (not run: 2 deferred)"
    shown = Status(step=30, accuracy=0.5, eval_version=20, evals_not_run=(1, 2))
    assert accuracy_text(shown) == "acc 0.500 (v20; not run: 1 skipped, 2 deferred)"


def test_no_trainer_seen_and_an_older_trainer_show_no_figure() -> None:
    assert "| acc - |" in render_line(Status(), None)
    # a trainer without eval_version: its eval_accuracy default 0 cannot be told from a 0
    old = summarise({"trainer": parse("# TYPE flywheel_trainer_step gauge\n"
                                      "flywheel_trainer_step 4\n"
                                      "# TYPE flywheel_trainer_eval_accuracy gauge\n"
                                      "flywheel_trainer_eval_accuracy 0\n")})  # fmt: skip
    assert accuracy_text(old) == "acc none yet"


def test_ages_read_at_a_glance() -> None:
    assert [ago(s) for s in (-1, 40, 119, 420, 7199, 9000)] == [
        "0 s", "40 s", "119 s", "7 min", "120 min", "2.5 h"
    ]  # fmt: skip

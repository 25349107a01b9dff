"""Held-out evaluation on the engines (`[trainer] eval_on = "engines"`): a real stack (CPU
engine and its rollout worker, sync, trainer, buffer; real NATS) on the tiny model.

- each due version's evaluation is reported with that version and its accuracy: sync's
  EvalResult on the WEIGHTS stream and the trainer's metrics row agree, version by version,
  and the engine that generated it is named;
- no answer came from another version (none aborted: sync held the engine on the version
  until its evaluation ran) and the run's last due version is evaluated;
- the trainer holds no second model: it loaded none for evaluating, while the evaluations
  ran (its `eval_models_loaded` counter, read during the run), and generated nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proto.messages import EvalRequest, EvalResult
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table
from tests.harness.streams import messages

RUN = "evalengines"
STEPS = 4
EVAL_EVERY = 2
pytestmark = pytest.mark.slow


def config(root: Path, model: Path) -> str:
    return run_file(
        RUN,
        stack=stack_table(root, model, engines=1),
        task={"source": {"type": "arithmetic", "digits": 1},
              "eval": {"source": {"type": "arithmetic", "digits": 2, "seed": 1000003},
                       "size": 24, "k": 2, "max_new_tokens": 8}},
        buffer={"samples_per_prompt": 4, "groups_per_step": 2, "max_new_tokens": 4,
                "max_staleness": 1, "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 4, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
        engine={"num_threads": 1},
        trainer={"publish_every": 1, "eval_every": EVAL_EVERY, "max_steps": STEPS,
                 "eval_on": "engines", "eval_max_share": 1.0,
                 "runtime": {"cpu_threads": 1}, "optim": {"lr": 1e-3}},
        sync={"tick_s": 0.1, "keep_last": 2},
    )  # fmt: skip


def rows(root: Path) -> list[dict[str, Any]]:
    path = root / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


@pytest.fixture(scope="module")
def finished(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The finished run: its directory, the trainer's counter read mid-run, the messages."""
    root = tmp_path_factory.mktemp("evalengines")
    cfg = root / "run.toml"
    cfg.write_text(config(root, tiny_model))
    with NatsServer(store_dir=root / "nats") as nats, Stack(cfg, nats.url) as st:
        with printing_logs_on_failure(st):
            st.start("engine-0", "rollout-0")
            st.start("sync", "trainer")
            st.start("buffer")
            trainer = st["trainer"]
            wait_for(lambda: any("eval_accuracy" in r for r in rows(root)), 300,
                     "the step-0 evaluation's row")  # fmt: skip
            # a scrape can time out on a loaded machine (None): read until one answers
            (loaded_mid_run,) = wait_for(
                lambda: read(trainer.metric("flywheel_trainer_eval_models_loaded_total")),
                60, "the trainer's metrics")  # fmt: skip
            wait_for(lambda: not trainer.alive, 900, f"the trainer to finish {STEPS} steps")
            assert f"reached max_steps={STEPS}" in trainer.log(), trainer.log()[-3000:]
            s = Subjects(RUN)
            results = messages(nats.url, RUN, "WEIGHTS", s.eval_results, EvalResult)
            asked = messages(nats.url, RUN, "WEIGHTS", s.eval_requested, EvalRequest)
            logs = {"trainer_log": trainer.log(), "sync_log": st["sync"].log()}
            return {"root": root, "loaded": loaded_mid_run, "results": results, "asked": asked,
                    **logs}  # fmt: skip


def test_each_evaluation_is_reported_with_its_version_and_accuracy(
    finished: dict[str, Any],
) -> None:
    evals = {r["step"]: r for r in rows(finished["root"]) if "eval_accuracy" in r}
    results = {m.version: m for m in finished["results"]}
    assert [m.version for m in finished["asked"]] == list(range(0, STEPS + 1, EVAL_EVERY))
    assert sorted(results) == [m.version for m in finished["asked"]]
    assert not [m for m in results.values() if m.outcome == "aborted"], results
    evaluated = {v: m for v, m in results.items() if m.outcome == "evaluated"}
    assert 0 in evaluated and STEPS in evaluated, results  # the first and the last due
    assert sorted(evals) == sorted(evaluated)
    for v, m in evaluated.items():
        (task,) = m.tasks
        assert m.engines == ("engine-0",)
        assert evals[v]["eval_accuracy"] == task.pass_at_1 and task.total == 24
        assert evals[v]["eval_pass_at_k"] == task.pass_at_k
        assert evals[v]["eval_known_s"] > 0
        assert m.requested_at <= m.started_at <= m.finished_at
    for v, m in sorted(evaluated.items()):
        on_engine = m.finished_at - m.started_at
        print(f"v{v}: known {evals[v]['eval_known_s']:.1f}s after asking, {on_engine:.1f}s there")


def read(value: float | None) -> tuple[float] | None:
    """A metric as wait_for's truthy answer (0.0 is a value, None none)."""
    return None if value is None else (value,)


def test_the_trainer_holds_no_second_model(finished: dict[str, Any]) -> None:
    assert finished["loaded"] == 0.0
    assert "on engine engine-0" in finished["trainer_log"]
    assert "v0 evaluated on engine-0" in finished["sync_log"]


def test_the_best_weights_are_the_best_evaluated_version(finished: dict[str, Any]) -> None:
    root = finished["root"]
    evals = [r for r in rows(root) if "eval_accuracy" in r and r["step"] > 0]
    top = max(r["eval_accuracy"] for r in evals)
    want = min(r["step"] for r in evals if r["eval_accuracy"] == top)
    best = json.loads((root / "checkpoints" / "best.json").read_text())
    assert best["step"] == want and best["accuracy"] == top, (best, evals)
    assert not list((root / "checkpoints" / ".eval").glob("*"))  # link copies removed

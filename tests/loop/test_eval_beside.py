"""Held-out evaluation runs beside training: the trainer keeps stepping while one is in
flight (services/trainer/evaluating.py: `eval_on = "trainer"`, a model copy in the trainer;
the engines' path: test_eval_engines.py).

One stack (a CPU engine and its rollout worker, sync, trainer, buffer; real
NATS) on the tiny model, with an evaluation made slow on purpose (many
held-out prompts, pass@k sampling, long generations) due every other step,
and the trainer stopping itself after a few steps. Before, the trainer
evaluated inside a step's recording, so step N + 2 waited for step N's
evaluation and no step's row could land while an evaluation ran. Now:

- trained rows of later steps are written while an evaluation runs (its row
  comes after them and says how many steps were trained meanwhile);
- evaluations run one at a time in version order, each due version
  evaluated or skipped for a newer one, and the run's end evaluates the
  last due version;
- the best weights are those of the highest validation accuracy (ties: the
  older version), among the evaluations that ran;
- the loop's time blocked behind the previous step's recording is small
  beside the evaluations' time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table

RUN = "evalbeside"
STEPS = 8
EVAL_EVERY = 2
pytestmark = pytest.mark.slow


def config(root: Path, model: Path) -> str:
    return run_file(
        RUN,
        stack=stack_table(root, model, engines=1),
        task={"source": {"type": "arithmetic", "digits": 1},
              # slow on purpose: 150 prompts, greedy and 4 samples each, up to 48 tokens
              "eval": {"source": {"type": "arithmetic", "digits": 2, "seed": 1000003},
                       "size": 150, "k": 4, "max_new_tokens": 48}},
        buffer={"samples_per_prompt": 4, "groups_per_step": 2, "max_new_tokens": 4,
                "max_staleness": 1, "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 4, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
        engine={"num_threads": 1},
        # eval_max_share 1.0: every due version evaluated or skipped for a newer one, never
        # deferred for its cost (what this test reads; the deferral: test_eval_budget.py)
        trainer={"publish_every": 1, "eval_every": EVAL_EVERY, "max_steps": STEPS,
                 "eval_max_share": 1.0, "eval_on": "trainer",
                 "runtime": {"cpu_threads": 1}, "optim": {"lr": 1e-3}},
        sync={"tick_s": 0.1, "keep_last": 2},
    )  # fmt: skip


@pytest.fixture(scope="module")
def finished(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a finished run (the trainer stopped itself after STEPS)."""
    root = tmp_path_factory.mktemp("evalbeside")
    cfg = root / "run.toml"
    cfg.write_text(config(root, tiny_model))
    with NatsServer(store_dir=root / "nats") as nats, Stack(cfg, nats.url) as st:
        with printing_logs_on_failure(st):
            st.start("engine-0", "rollout-0")  # the worker waits for its engine
            st.start("sync", "trainer")
            st.start("buffer")
            trainer = st["trainer"]
            wait_for(lambda: not trainer.alive, 900, f"the trainer to finish {STEPS} steps")
            assert f"reached max_steps={STEPS}" in trainer.log(), trainer.log()[-3000:]
    return root


def rows(root: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines() if x]


def test_steps_are_trained_while_an_evaluation_runs(finished: Path) -> None:
    got = rows(finished)
    trained = [r for r in got if "batch_id" in r]
    evals = [(i, r) for i, r in enumerate(got) if "eval_accuracy" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    print("\n" + "\n".join(
        f"v{r['step']}: {r['eval_s']:.1f}s, {r['eval_lag_steps']} steps meanwhile, "
        f"{sum(1 for t in got[:i] if 'batch_id' in t and t['step'] > r['step'])} rows before it"
        for i, r in evals))  # fmt: skip
    # rows of later steps landed while an evaluation ran: before it, they could not
    overlapped = [
        r for i, r in evals
        if sum(1 for t in got[:i] if "batch_id" in t and t["step"] > r["step"]) >= 2
    ]  # fmt: skip
    assert overlapped, [r for _, r in evals]
    assert all(r["eval_lag_steps"] >= 2 for r in overlapped)
    blocked = sum(r["blocked_s"] for r in trained)
    assert all(r["trim_s"] >= 0 for r in trained)  # the step's malloc_trim: timed apart
    evaluating = sum(r["eval_s"] for _, r in evals)
    print(f"blocked behind recording {blocked:.2f}s in all, evaluations {evaluating:.1f}s")
    assert blocked < 0.25 * evaluating


def test_evaluations_run_in_version_order_and_the_last_due_one_runs(finished: Path) -> None:
    steps = [r["step"] for r in rows(finished) if "eval_accuracy" in r]
    assert steps[0] == 0 and steps == sorted(set(steps)), steps
    assert all(s % EVAL_EVERY == 0 for s in steps)
    assert steps[-1] == STEPS  # a run that ends by itself evaluates its last due version
    assert not list((finished / "checkpoints" / ".eval").glob("*"))  # link copies removed
    evals = [r for r in rows(finished) if "eval_accuracy" in r]
    # the running estimate of what they cost the steps beside them (evalbudget.py)
    assert all(0.0 <= r["eval_cost_share"] <= 1.0 for r in evals), evals
    assert all(r["evals_deferred"] == 0 for r in evals), evals


def test_the_best_weights_are_the_best_evaluated_version(finished: Path) -> None:
    evals = [r for r in rows(finished) if "eval_accuracy" in r and r["step"] > 0]
    top = max(r["eval_accuracy"] for r in evals)
    want = min(r["step"] for r in evals if r["eval_accuracy"] == top)  # ties: the older
    best = json.loads((finished / "checkpoints" / "best.json").read_text())
    assert best["step"] == want and best["accuracy"] == top, (best, evals)
    assert (finished / "checkpoints" / "best" / "config.json").is_file()


def test_pass_at_1_is_written_before_its_samples_are_drawn(finished: Path) -> None:
    """A pass@k row (k = 4) follows its version's pass@1 row; an older version's samples
    give way to a newer due version's pass@1, but the run's last version gets its pass@k."""
    got = rows(finished)
    for i, r in enumerate(got):
        if "eval_pass_at_k" in r:
            (first,) = [j for j, t in enumerate(got) if "eval_accuracy" in t
                        and t["step"] == r["step"]]  # fmt: skip
            assert first < i and r["eval_k_s"] >= got[first]["eval_s"], (r, got[first])
    assert [r["step"] for r in got if "eval_pass_at_k" in r][-1] == STEPS

"""The evaluations' cost to the steps beside them, and the rule that defers a due one
(services/trainer/evalbudget.py), on synthetic step times with closed-form answers; and
the deferral as the trainer's evaluations apply it (services/trainer/evaluating.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.trainer.evalbudget import MIN_ALONE, WINDOW, EvalBudget
from services.trainer.evaluating import Due, Evaluations
from services.trainer.heldout import HeldOut
from services.trainer.metrics import Recorder
from services.trainer.settings import TrainerSettings


def run(budget: EvalBudget, t: float, gaps: list[float]) -> float:
    """Steps ending one after the other, `gaps` seconds apart from `t`; the last end."""
    for g in gaps:
        t += g
        budget.stepped(t)
    return t


def one_evaluation(max_share: float | None = 0.05) -> EvalBudget:
    """Five alone gaps of 10 s, an evaluation of v5 beside two gaps of 16 s and 13 s (it
    ends during the second), one more alone gap of 10 s: cost (16-10)+(13-10) = 9 s of
    5*10 + 16 + 13 + 10 = 89 s of RL."""
    b = EvalBudget(max_share)
    t = run(b, 0.0, [0.0, 10, 10, 10, 10, 10])  # the first end starts the clock
    b.started(5)
    t = run(b, t, [16])
    b.ended()  # during the next gap: it is beside too
    t = run(b, t, [13, 10])
    return b


def test_no_evaluation_costs_nothing() -> None:
    b = EvalBudget(0.001)
    run(b, 0.0, [0.0, 10, 12, 9, 30])
    assert (b.cost_s, b.share, b.rl_s) == (0.0, 0.0, 61.0)
    assert not b.over() and not b.defers(5)


def test_cost_is_the_beside_gaps_excess_over_the_median_alone_gap() -> None:
    b = one_evaluation()
    assert list(b.alone) == [10, 10, 10, 10, 10, 10] and b.beside == [16, 13]
    assert b.typical_s == 10
    assert b.cost_s == pytest.approx(9.0)
    assert b.rl_s == pytest.approx(89.0)
    assert b.share == pytest.approx(9 / 89)


def test_a_beside_gap_shorter_than_the_median_costs_nothing() -> None:
    b = EvalBudget(0.05)
    t = run(b, 0.0, [0.0, 10, 10, 10])
    b.started(5)
    run(b, t, [8, 12])
    assert b.cost_s == pytest.approx(2.0)  # max(0, 8-10) + (12-10)


def test_the_median_is_robust_to_an_odd_slow_step() -> None:
    b = EvalBudget(0.05)
    t = run(b, 0.0, [0.0, 10, 10, 10, 100, 10])  # a 100 s stall (a slow batch) alone
    b.started(5)
    run(b, t, [15])
    assert b.typical_s == 10 and b.cost_s == pytest.approx(5.0)


def test_the_median_is_of_the_recent_alone_gaps() -> None:
    b = EvalBudget(0.05)
    t = run(b, 0.0, [0.0] + [20] * WINDOW + [10] * WINDOW)  # the steps got faster
    b.started(5)
    run(b, t, [25])
    assert b.typical_s == 10 and b.cost_s == pytest.approx(15.0)


def test_the_cost_is_unknown_until_a_few_alone_gaps() -> None:
    b = EvalBudget(0.001)
    t = run(b, 0.0, [0.0] + [10] * (MIN_ALONE - 1))
    b.started(5)
    t = run(b, t, [50, 50])
    b.ended()
    assert b.typical_s is None and b.cost_s == 0.0 and not b.defers(10)
    run(b, t, [10, 10])  # MIN_ALONE alone gaps now (the one it ended in was beside)
    assert b.typical_s == 10 and b.cost_s == pytest.approx(80.0) and b.defers(10)


def test_the_step_0_evaluation_is_neither_beside_nor_alone() -> None:
    """It runs once, before anything trained, and is never deferred (beside_share in
    bench/demo_real_seeds.py leaves it out too); its gaps are not a typical step either."""
    b = EvalBudget(0.001)
    b.started(0)
    t = run(b, 0.0, [0.0, 30, 30])
    b.ended()
    t = run(b, t, [10, 10, 10, 10])
    assert list(b.alone) == [10, 10, 10] and b.beside == []
    assert b.cost_s == 0.0 and b.rl_s == pytest.approx(100.0)


def test_deferred_while_over_the_share() -> None:
    # 9 s of 89 s: 10.1%
    assert one_evaluation(0.05).defers(10)
    assert not one_evaluation(0.15).defers(10)
    assert not one_evaluation(None).defers(10)
    assert not one_evaluation(1.0).defers(10)  # cost <= RL seconds: 1.0 never defers


def test_step_0_and_the_last_step_are_never_deferred() -> None:
    b = one_evaluation(0.001)
    assert b.defers(10)
    assert not b.defers(0)
    assert not b.defers(10, last=True)


def test_a_figure_too_old_runs_the_next_due_evaluation_whatever_it_costs() -> None:
    """Over budget (10.1% of 89 s against 0.1%), deferred while the newest evaluation (v5,
    started at 50 s of RL) is under max_age_s old; the first due version at or past it runs,
    and the clock starts again from that one."""
    b = EvalBudget(0.001, max_age_s=60)
    t = run(b, 0.0, [0.0, 10, 10, 10, 10, 10])
    b.started(5)  # at 50 s of RL
    t = run(b, t, [16])
    b.ended()
    t = run(b, t, [13, 10])  # 89 s: 39 s after it started
    assert b.over() and not b.aged() and b.defers(10)
    t = run(b, t, [10, 10])  # 109 s: 59 s
    assert b.defers(12)
    t = run(b, t, [1])  # 110 s: 60 s
    assert b.aged() and not b.defers(13)
    assert "started 60 s of RL ago, over [trainer] eval_max_age_s (60 s)" in b.age_line()
    b.started(13)
    run(b, t, [10])
    assert not b.aged() and b.defers(14)
    assert one_evaluation(0.001).defers(10)  # no max_age_s: the share alone decides


def test_the_default_age_bound_is_ten_minutes_of_rl() -> None:
    assert TrainerSettings.model_fields["eval_max_age_s"].default == 600.0


def test_an_evaluation_is_deferred_again_until_the_cost_fits() -> None:
    """Over budget, evaluations are spread out: alone steps grow the RL seconds until
    9 s is within 5% of them (9 / 0.05 = 180 s: 10 more gaps of 10 s from 89 s)."""
    b = one_evaluation(0.05)
    t = 89.0
    for _ in range(9):
        t = run(b, t, [10])
        assert b.defers(15)
    run(b, t, [10])
    assert b.rl_s == pytest.approx(189.0) and not b.defers(15)


def test_the_line_gives_the_figures() -> None:
    assert one_evaluation(0.05).line() == (
        "evaluations cost 9 s of 89 s of RL (10.1%), over eval_max_share 5%"
    )


def test_settings_default_and_bounds() -> None:
    task = {"source": {"type": "arithmetic"}}
    assert TrainerSettings(task=task).eval_max_share == 0.05
    assert TrainerSettings(task=task, eval_max_share=None).eval_max_share is None
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            TrainerSettings(task=task, eval_max_share=bad)


def test_the_trainer_s_evaluations_defer_count_and_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over budget, a due evaluation is not started (nothing in flight, no link copy of its
    weights), counted and logged with the figures."""
    s = TrainerSettings(
        run="budget", task={"source": {"type": "arithmetic"}}, metrics_file=tmp_path / "m.jsonl"
    )
    registry = CollectorRegistry()
    recorder = Recorder(registry, s)
    evals = Evaluations(HeldOut(s), recorder, tmp_path / "ckpt", lambda: 10, one_evaluation())
    caplog.set_level(logging.INFO, logger="services.trainer.evaluating")

    async def due() -> None:
        await evals.submit(10, tmp_path / "v000010", 89.0)

    asyncio.run(due())
    recorder.close()
    assert evals.deferred == 1 and not evals.in_flight and evals.pending is None
    assert not (tmp_path / "ckpt" / ".eval").exists()
    assert registry.get_sample_value("flywheel_trainer_evals_deferred_total") == 1
    assert (
        "held-out evaluation of v10 deferred: evaluations cost 9 s of 89 s of RL (10.1%), "
        "over eval_max_share 5%" in caplog.text
    )


def test_an_evaluation_beside_every_step_defers_until_the_loop_is_seen_alone() -> None:
    """No alone gap yet (the step-0 evaluation, then one of v5, each outlasting the steps
    to the next due one): the cost is unknown, and after MIN_ALONE beside gaps that
    defers, so the loop runs alone long enough to tell what a step costs."""
    b = EvalBudget(0.05)
    b.started(0)
    t = run(b, 0.0, [0.0, 60, 60])
    b.ended()
    b.started(5)
    t = run(b, t, [60] * (MIN_ALONE - 1))
    assert b.typical_s is None and not b.defers(10)
    t = run(b, t, [60])
    assert b.defers(10)
    assert b.line() == (
        f"evaluations cost unknown after 300 s of RL: {MIN_ALONE} steps had one beside, "
        "none ran alone (eval_max_share 5%)"
    )
    assert not EvalBudget(1.0).defers(10) and not b.defers(10, last=True)
    b.ended()
    # the gap it ended in is beside, the next MIN_ALONE alone: 3 x (60 - 40) of 460 s
    run(b, t, [40] * (MIN_ALONE + 1))
    assert b.typical_s == 40 and b.cost_s == pytest.approx(60.0) and b.defers(10)
    assert b.rl_s == pytest.approx(460.0)


def test_the_console_is_told_once_per_kind_why_an_evaluation_did_not_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first deferral and the first skip each warn (what the console shows) in a user's
    words with the keys that help; later ones are logged at INFO and counted only."""
    s = TrainerSettings(
        run="told", task={"source": {"type": "arithmetic"}}, metrics_file=tmp_path / "m.jsonl"
    )
    registry = CollectorRegistry()
    recorder = Recorder(registry, s)
    evals = Evaluations(HeldOut(s), recorder, tmp_path / "ckpt", lambda: 20, one_evaluation())
    caplog.set_level(logging.INFO, logger="services.trainer.evaluating")

    async def due() -> None:
        for step in (10, 15):
            await evals.submit(step, tmp_path / f"v{step:06d}", 89.0)

    asyncio.run(due())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "trainer: held-out evaluation of v10 not run (deferred): the evaluations have slowed "
        "the training by 9 s of 89 s (10.1%), more than [trainer] eval_max_share (5%) allows. "
        "Later due versions are tried again; the status line counts those not run. For more "
        "evaluations: raise [trainer] eval_max_share (1.0: never defer) or make one cheaper "
        "([task.eval] size, k, max_new_tokens)"
    ]
    assert "held-out evaluation of v15 deferred" in caplog.text  # logged, not warned again
    assert registry.get_sample_value("flywheel_trainer_evals_deferred_total") == 2
    # a skip: one warning of its own kind, then INFO only
    for step, newer in ((20, 25), (25, 30)):
        evals._skip(Due(step, tmp_path / "gone", 0.0, owned=False), newer=newer)
    recorder.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and warned[1].startswith(
        "trainer: held-out evaluation of v20 not run (skipped): v25 fell due while an "
        "evaluation was still running"
    )
    assert "raise eval_every" in warned[1]


def test_an_unknown_cost_is_explained_as_such() -> None:
    b = EvalBudget(0.05)
    b.started(5)
    run(b, 0.0, [0.0] + [60] * MIN_ALONE)
    assert b.explain().startswith(
        f"an evaluation was running beside every step so far ({MIN_ALONE} steps, 180 s), so "
        "what evaluations cost the training cannot be measured yet"
    )

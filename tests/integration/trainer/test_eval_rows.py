"""The trainer's evaluation rows (services/trainer/evaluating.py) with a real held-out
evaluation on the tiny model: greedy pass@1 gets its row before the pass@k samples are
drawn, pass@k a row of its own after; a run told to stop calls the samples off."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.trainer.evalbudget import EvalBudget
from services.trainer.evaluating import Evaluations
from services.trainer.heldout import HeldOut
from services.trainer.metrics import Recorder
from services.trainer.settings import TrainerSettings


def settings(
    tmp_path: Path, size: int, k: int, max_new_tokens: int, **more: Any
) -> TrainerSettings:
    eval_ = {"source": {"type": "arithmetic", "seed": 1}, "size": size, "k": k,
             "temperature": 1.0, "max_new_tokens": max_new_tokens}  # fmt: skip
    return TrainerSettings(
        run="evalrows",
        task={"source": {"type": "arithmetic"}, "eval": eval_},
        eval_every=1,
        eval_on="trainer",
        eval_max_share=None,
        metrics_file=tmp_path / "m.jsonl",
        **more,
    )


def evaluate(
    s: TrainerSettings, model: Path, tmp_path: Path, then: str = "end"
) -> tuple[list[dict[str, Any]], float, bool]:
    """Submit the step-0 evaluation, and once its pass@1 row is written: close as a run
    that ended by itself ("end"), as one told to stop ("stop"), or submit v1 and stop once
    v1's pass@1 row is written too ("newer"). Returns (rows, seconds the close took,
    whether v0's samples were halted)."""
    recorder = Recorder(CollectorRegistry(), s)

    async def body() -> tuple[float, bool]:
        async with HeldOut(s) as heldout:
            evals = Evaluations(heldout, recorder, tmp_path / "ckpt", lambda: 1)
            await evals.submit(0, model, 0.0)
            v0 = evals.flight
            assert v0 is not None
            while then != "end" and not v0.sampling:
                await asyncio.sleep(0.05)
            if then == "newer":  # v1 starts at once; its own samples are called off at the end
                await evals.submit(1, model, 5.0)
                v1 = evals.flight
                assert v1 is not None and v1 is not v0
                while not v1.sampling:
                    await asyncio.sleep(0.05)
            t = time.perf_counter()
            await evals.close(finish_pending=then == "end")
            return time.perf_counter() - t, v0.halt.is_set()

    took, halted = asyncio.run(body())
    recorder.close()
    assert s.metrics_file is not None
    rows = [json.loads(x) for x in s.metrics_file.read_text().splitlines() if x]
    return rows, took, halted


def kinds(rows: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(r["step"], "pass@1" if "eval_accuracy" in r else "pass@k") for r in rows]


def test_pass_at_1_has_its_row_before_the_samples_and_pass_at_k_one_after(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows, _, halted = evaluate(settings(tmp_path, 8, 3, 4), tiny_model_dir, tmp_path)
    first, second = rows
    assert first["step"] == second["step"] == 0 and not halted
    assert "eval_accuracy" in first and "eval_pass_at_k" not in first
    assert "eval_pass_at_k" in second and "eval_accuracy" not in second
    assert second["eval_k_s"] >= first["eval_s"] > 0
    assert second["time"] >= first["time"] and second["elapsed"] == first["elapsed"]
    assert second["eval_pass_at_k"] >= first["eval_accuracy"] - 1e-9  # pass@3 vs greedy


def test_a_run_told_to_stop_calls_the_samples_off(tiny_model_dir: Path, tmp_path: Path) -> None:
    """64 rows x 8 samples of up to 64 tokens: seconds of generation, cut at the next token."""
    s = settings(tmp_path, 64, 8, 64)
    rows, took, halted = evaluate(s, tiny_model_dir, tmp_path, "stop")
    assert halted and kinds(rows) == [(0, "pass@1")]
    assert took < 2.0, took


def test_a_newer_version_s_pass_at_1_goes_before_an_older_one_s_samples(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.trainer.evaluating")
    s = settings(tmp_path, 64, 8, 64)
    rows, _, halted = evaluate(s, tiny_model_dir, tmp_path, "newer")
    assert halted and kinds(rows) == [(0, "pass@1"), (1, "pass@1")]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "pass@k of v0 called off: v1 is due" in warned[0], warned


@pytest.mark.parametrize(("eval_nice", "counted"), [(19, False), (0, True)])
def test_the_budget_counts_the_samples_only_at_the_greedy_pass_s_priority(
    tiny_model_dir: Path, tmp_path: Path, eval_nice: int, counted: bool
) -> None:
    """While v1's pass@k samples are drawn at nice 19 a step's gap is alone (they yield
    the cores and are called off by the next due version); at nice 0 it is beside."""
    s = settings(tmp_path, 64, 8, 64, eval_nice=eval_nice, eval_greedy_nice=0)
    budget = EvalBudget(0.05)

    async def body() -> tuple[bool | None, bool | None]:
        async with HeldOut(s) as heldout:
            evals = Evaluations(heldout, Recorder(CollectorRegistry(), s), tmp_path / "c",
                                lambda: 1, budget)  # fmt: skip
            await evals.submit(1, tiny_model_dir, 0.0)
            v1 = evals.flight
            assert v1 is not None
            during_greedy = budget.running
            while not v1.sampling:
                await asyncio.sleep(0.05)
            during_samples = budget.running
            await evals.close(finish_pending=False)
            return during_greedy, during_samples

    greedy, samples = asyncio.run(body())
    assert greedy is True and samples is (True if counted else None), (greedy, samples)

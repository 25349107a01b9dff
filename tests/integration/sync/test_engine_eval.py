"""The held-out evaluation through an engine (services/tasks/engine_eval.py), against a real
CPU engine on the tiny model: the same figures as the in-process path's greedy pass@1, and
no figure of a version the engine does not serve."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proto.messages import EvalResult
from services.engine_api.engine_client import EngineClient
from services.tasks.arithmetic import ArithmeticSource
from services.tasks.engine_eval import EvalAborted, engine_complete, figures, report_of
from services.tasks.evaluate import evaluate, evaluate_dir, load_model
from services.tasks.scoring import Scorer, verifier_pool
from services.tasks.spec import EvalSpec, TaskSpec
from services.tasks.taskset import TaskSet
from tests.harness.engines import EngineStates, serving_engine

ROWS = 12


@pytest.fixture(scope="module")
def engine_state(tiny_model: Path) -> Iterator[Any]:
    states = EngineStates(tiny_model)
    yield states.get()
    states.close()


def tasks(k: int = 1) -> TaskSet:
    spec = TaskSpec(
        source=ArithmeticSource(type="arithmetic"),
        eval=EvalSpec(
            source=ArithmeticSource(type="arithmetic", seed=1), size=ROWS, max_new_tokens=6, k=k
        ),
    )
    return TaskSet({"arithmetic": spec}, {"arithmetic": "[task]"})


async def on_engine(state: Any, model: Path, version: int, k: int = 1) -> Any:
    t = tasks(k)
    _, tokenizer = load_model(model)
    async with serving_engine(state) as url, EngineClient(url) as c, verifier_pool(t) as pool:
        complete = engine_complete(c, tokenizer, version, concurrency=4)
        return await evaluate(
            None, tokenizer, t.load(), Scorer(t, pool), split="validation", complete=complete
        )


def test_the_engine_gives_the_figures_the_model_gives_here(
    engine_state: Any, tiny_model: Path
) -> None:
    """Greedy pass@1 and mean reward on the engine equal the in-process path's on the same
    weights (version 0, the engine's), and survive the wire (EvalResult) unchanged."""
    here = evaluate_dir(tiny_model, tasks(), split="validation").tasks["arithmetic"]
    report = asyncio.run(on_engine(engine_state, tiny_model, 0))
    there = report.tasks["arithmetic"]
    assert there.total == here.total == ROWS
    assert (there.pass_at_1, there.mean_reward) == (here.pass_at_1, here.mean_reward)
    wire = EvalResult(run="r", version=0, outcome="evaluated", tasks=figures(report))
    assert report_of(wire).metrics() == report.metrics()


def test_pass_at_k_samples_k_answers_per_prompt_on_the_engine(
    engine_state: Any, tiny_model: Path
) -> None:
    report = asyncio.run(on_engine(engine_state, tiny_model, 0, k=3))
    t = report.tasks["arithmetic"]
    assert t.k == 3 and t.pass_at_k is not None and t.pass_at_k >= t.pass_at_1


def test_an_answer_of_another_version_aborts_the_evaluation(
    engine_state: Any, tiny_model: Path
) -> None:
    """The engine serves v0; an evaluation of v1 must not count its answers."""
    with pytest.raises(EvalAborted, match="answered with v0 while v1 was evaluated"):
        asyncio.run(on_engine(engine_state, tiny_model, 1))


def test_a_lora_version_is_evaluated_with_its_adapter(tiny_model: Path, tmp_path: Path) -> None:
    """A LoRA run's version v is the adapter loaded as `v000001` beside the base (whose own
    weight_version stays 0): sampled by that name, its answers count as v's."""
    from proto.weight_version import adapter_name
    from tests.harness.lora import write_adapter

    adapter = write_adapter(tmp_path / "v000001", tiny_model, targets=("q_proj", "v_proj"))
    states = EngineStates(tiny_model)
    state = states.get(enable_lora=True, max_lora_rank=8,
                       lora_target_modules=["q_proj", "v_proj"], max_loras_per_batch=4)  # fmt: skip
    t = tasks()

    async def body() -> Any:
        _, tokenizer = load_model(tiny_model)
        async with serving_engine(state) as url, EngineClient(url) as c, verifier_pool(t) as pool:
            await c.load_lora_adapter(adapter_name(1), str(adapter))
            complete = engine_complete(c, tokenizer, 1, lora_path=adapter_name(1))
            return await evaluate(None, tokenizer, t.load(), Scorer(t, pool), complete=complete)

    try:
        report = asyncio.run(body())
    finally:
        states.close()
    assert report.tasks["arithmetic"].total == ROWS

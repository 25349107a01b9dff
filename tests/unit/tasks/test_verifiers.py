"""A `verifiers` environment as a task (extra: verifiers; skipped without it).

The environment is tests/unit/tasks/verifiers_env_fixture.py, written as a
verifiers user writes one; Flywheel loads it by id, unmodified: its dataset
rows are the prompts, its rubric scores a right and a wrong answer apart,
in-process and in the verifier sandbox's child as a rollout worker scores.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from services.runtime.errors import ConfigError
from services.tasks import rewards as R
from services.tasks.scoring import Scorer, reward_payload, verifier_pool
from services.tasks.settings import TaskServiceSettings
from services.tasks.spec import TaskSpec
from services.tasks.verifiers_env import VerifiersSource
from tests.harness.extras import require_verifiers
from tests.unit.tasks.test_spec import settings

ENV = "tests.unit.tasks.verifiers_env_fixture"
RUN = f'[task]\nsource = {{ type = "verifiers", env = "{ENV}", args = {{ n = 4 }} }}\n'


def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.tasks.verifiers_env import VerifiersRows

    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'flywheel\[verifiers\]'"):
        len(VerifiersRows(VerifiersSource(type="verifiers", env="not-loaded-yet")))


def test_the_rubric_is_the_default_reward_and_needs_a_verifiers_source(tmp_path: Path) -> None:
    s = settings(tmp_path, RUN, TaskServiceSettings)
    assert s.task is not None and [p.fn for p in s.task.reward] == ["verifiers"]
    assert s.task_set().names == [f"verifiers:{ENV}"]
    with pytest.raises(ValueError, match="'verifiers' needs source type 'verifiers'"):
        TaskSpec.model_validate({"source": {"type": "arithmetic"}, "reward": "verifiers"})


def test_rows_are_the_envs_dataset_and_its_rubric_scores_them(tmp_path: Path) -> None:
    require_verifiers()
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    loaded = settings(tmp_path, RUN).task_set().load()[f"verifiers:{ENV}"]
    # Loading an env installs exit-at-once signal handlers; a service's stay.
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert len(loaded.rows) == 4
    row = loaded.rows.row(2)
    assert row.messages == (
        {"role": "system", "content": "Add the numbers."},
        {"role": "user", "content": "2+3="},
    )
    assert row.answer == "5"
    parts = reward_payload(loaded.spec)
    ctx = {"row": 2, "source": loaded.spec.source.model_dump(mode="json")}
    right = R.score(parts, "5", row.answer, ctx)
    wrong = R.score(parts, "50000", row.answer, ctx)
    assert right["reward"] == 1.5 and right["parts"]["verifiers.correct_answer"] == 1.0
    assert wrong["reward"] == 0.0 and wrong["parts"]["verifiers.short"] == 0.0


def test_the_sandbox_child_scores_with_the_rubric(tmp_path: Path) -> None:
    require_verifiers()
    tasks = settings(tmp_path, RUN + 'eval.source = { type = "verifiers", env = "' + ENV
                     + '", args = { n = 4 }, split = "eval" }\n').task_set()  # fmt: skip
    name = tasks.names[0]

    async def body() -> list[float]:
        async with verifier_pool(tasks, size=1, timeout_s=60.0) as pool:
            scorer = Scorer(tasks, pool)
            got = [await scorer.score(name, 3, c, "7", 1) for c in ("7", "8")]
            held = await scorer.score(name, 1, "3", "3", 1, split="validation")
        assert all(r.error is None for r in [*got, held]), [*got, held]
        return [r.reward for r in [*got, held]]

    assert asyncio.run(body()) == [1.5, 0.5, 1.5]

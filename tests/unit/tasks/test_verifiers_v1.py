"""A verifiers v1 taskset as a task (extra: verifiers>=0.3.1; skipped without it).

The tasksets are tests/fixtures/verifiers_v1 (written as a verifiers user
writes them); Flywheel loads them by id: their tasks are the rows, their
env runs every seat locally on Flywheel's in-process chat loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.runtime.errors import ConfigError
from services.tasks.settings import TaskServiceSettings
from services.tasks.spec import TaskSpec
from services.tasks.verifiers_v1 import V1Rows, VerifiersV1Source, load_env
from tests.harness import REPO
from tests.harness.extras import require_verifiers_v1
from tests.unit.tasks.test_spec import settings

ENVS = REPO / "tests" / "fixtures" / "verifiers_v1"
RUN = (
    '[task]\nsource = { type = "verifiers-v1", taskset = "fw-add-v1", args = { num_tasks = 3 } }\n'
    'sandbox = "insecure-allow"\n'
)


@pytest.fixture(autouse=True)
def _envs_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))  # verifiers imports a taskset id top-level


def test_the_envs_rewards_are_the_default_and_need_a_v1_source(tmp_path: Path) -> None:
    s = settings(tmp_path, RUN, TaskServiceSettings)
    assert s.task is not None and [p.fn for p in s.task.reward] == ["verifiers-v1"]
    assert s.task_set().names == ["verifiers-v1:fw-add-v1"]
    with pytest.raises(ValueError, match="'verifiers-v1' needs source type 'verifiers-v1'"):
        TaskSpec.model_validate({"source": {"type": "arithmetic"}, "reward": "verifiers-v1"})


def test_held_out_evaluation_of_a_v1_env_is_refused_at_start_up() -> None:
    src = {"type": "verifiers-v1", "taskset": "fw-add-v1"}
    with pytest.raises(ValueError, match="training source only"):
        TaskSpec.model_validate(
            {"source": src, "eval": {"source": src}, "sandbox": "insecure-allow"}
        )


def test_a_v1_env_outside_the_sandbox_must_be_accepted_in_the_run_file() -> None:
    """Its rewards run in the rollout worker's process: never by default."""
    src = {"type": "verifiers-v1", "taskset": "fw-add-v1"}
    with pytest.raises(ValueError, match='sandbox = "insecure-allow"'):
        TaskSpec.model_validate({"source": src})
    assert TaskSpec.model_validate({"source": src, "sandbox": "insecure-allow"})


def test_rows_are_the_tasksets_tasks() -> None:
    require_verifiers_v1()
    add = V1Rows(VerifiersV1Source(type="verifiers-v1", taskset="fw-add-v1", args={"num_tasks": 3}))
    assert len(add) == 3
    row = add.row(2)
    assert row.messages == (
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "2+3="},
    )
    assert row.answer == "5"
    recall = VerifiersV1Source(type="verifiers-v1", taskset="fw-recall-v1", limit=2)
    assert len(V1Rows(recall)) == 2


def test_every_seat_runs_locally_on_flywheels_loop() -> None:
    require_verifiers_v1()
    env = load_env(VerifiersV1Source(type="verifiers-v1", taskset="fw-recall-v1").key())
    assert type(env).__name__ == "RecallEnv"  # the taskset's own Env
    seat = env.config.agent
    assert seat.harness.id == "flywheel_chat" and seat.runtime.type == "subprocess"


def test_a_bad_taskset_id_fails_at_start_up_naming_it() -> None:
    require_verifiers_v1()
    src = VerifiersV1Source(type="verifiers-v1", taskset="no-such-taskset")
    with pytest.raises(ConfigError, match="no-such-taskset"):
        src.check("[task] source", data=False)


def test_an_older_verifiers_is_named_with_the_release_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_verifiers_v1()
    import verifiers

    monkeypatch.setattr(verifiers, "__version__", "0.2.1")  # it ships another verifiers.v1
    src = VerifiersV1Source(type="verifiers-v1", taskset="fw-add-v1", args={"num_tasks": 5})
    with pytest.raises(ConfigError, match=r"verifiers>=0\.3\.1 \(installed: 0\.2\.1\)"):
        src.check("[task] source", data=False)

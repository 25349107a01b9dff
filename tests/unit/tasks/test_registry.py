"""A reward registered in one file (shout_reward.py) is usable from a run file at once:
validated, shown by --print-config and the task spec's JSON schema, named in the errors,
and scored in the verifier sandbox's child process, which imports its module itself."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from services.buffer.settings import BufferSettings
from services.runtime.errors import EXIT_CONFIG
from services.runtime.service_main import settings_or_exit
from services.tasks import rewards
from services.tasks.registry import REWARDS, builtin_rewards
from services.tasks.scoring import reward_payload, verifier_pool
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet
from tests.unit.tasks import shout_reward

TASK = '[task]\nsource = {{ type = "arithmetic" }}\nreward = [{{ fn = "{fn}", min_len = {n} }}]\n'


def run_file(tmp_path: Path, fn: str = "shout", n: int = 3) -> Path:
    path = tmp_path / f"{fn}-{n}.toml"
    path.write_text(TASK.format(fn=fn, n=n))
    return path


def test_the_registry_lists_it_beside_the_built_ins() -> None:
    assert REWARDS.kinds["shout"] is shout_reward.Shout
    assert "shout" in builtin_rewards() and "exact_match" in builtin_rewards()


def test_a_run_file_uses_it_and_print_config_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        settings_or_exit("buffer", BufferSettings, str(run_file(tmp_path)), print_config=True)
    assert done.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["task"]["reward"] == [{"weight": 1.0, "name": None, "fn": "shout", "min_len": 3}]
    schema = json.dumps(TaskSpec.model_json_schema())
    assert '"const": "shout"' in schema and "Shortest completion that counts." in schema


def test_its_errors_name_the_key_and_list_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in (run_file(tmp_path, n=0), run_file(tmp_path, fn="shuot")):
        with pytest.raises(SystemExit) as failed:
            settings_or_exit("buffer", BufferSettings, str(path), print_config=True)
        assert failed.value.code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "[task] reward[0].min_len: Input should be greater than or equal to 1" in err
    assert "[task] reward[0]: fn must be one of" in err and "shout" in err.rsplit("fn must", 1)[1]


def test_the_sandbox_child_scores_it(tmp_path: Path, run_async: Any) -> None:
    spec = TaskSpec.model_validate({"source": {"type": "arithmetic"}, "reward": "shout"})
    parts = reward_payload(spec)
    assert parts[0]["_module"] == "tests.unit.tasks.shout_reward"

    tasks = TaskSet({"arithmetic": spec}, {"arithmetic": "[task]"})
    pool = verifier_pool(tasks, size=1, timeout_s=30.0)
    # The sandbox shows the module that defines it, and it is user code: walls required.
    assert "tests.unit.tasks.shout_reward" in pool.sandbox.modules
    assert pool.sandbox.required_by == ("[task]",)
    # The scoring itself holds with walls or without (tests/harness/sandbox.py).
    pool.sandbox = replace(pool.sandbox, required_by=())

    async def body() -> None:
        async with pool:
            loud = await pool.call(rewards.SCORE, parts, "HEY", None, {})
            quiet = await pool.call(rewards.SCORE, parts, "hey", None, {})
        assert (loud.reward, loud.parts, loud.error) == (1.0, {"shout": 1.0}, None)
        assert (quiet.reward, quiet.error) == (0.0, None)

    run_async(body(), timeout_s=60)

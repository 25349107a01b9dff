"""Which code needs the sandbox, what happens on a host without one, and what a tool's
process inherits.

A host without a sandbox is made by replacing `jail.probe` (the one place that
asks the host), so these run everywhere; where the host has one, the
confined side is checked too.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from services.runtime.errors import ConfigError
from services.sandbox import jail
from services.tasks import rewards as R
from services.tasks.scoring import reward_payload, tool_pool, verifier_pool
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet
from services.tasks.tools import CALL
from tests.harness.sandbox import require_sandbox

CUSTOM = "tests.unit.tasks.fixtures:shouting"
ENV_TOOL = "tests.integration.sandbox.escape_fixtures:environment"


def task_set(**tables: dict[str, Any]) -> TaskSet:
    specs = {n: TaskSpec.model_validate(t) for n, t in tables.items()}
    return TaskSet(specs, {n: f"[tasks.{n}]" for n in specs})


def episode(*tools: dict[str, Any]) -> dict[str, Any]:
    return {"tools": list(tools), "tool_timeout_s": 5.0}


@pytest.fixture
def no_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jail, "probe", lambda: "bwrap is not installed")


def test_custom_rewards_and_tools_refuse_to_start_without_a_sandbox(no_sandbox: None) -> None:
    tasks = task_set(
        plain={"source": {"type": "arithmetic"}},
        custom={"source": {"type": "arithmetic"}, "reward": CUSTOM},
        tools={"source": {"type": "arithmetic"}, "episode": episode({"type": "python"})},
    )
    with pytest.raises(ConfigError) as e:
        asyncio.run(verifier_pool(tasks).start())
    line = str(e.value)
    assert "[tasks.custom]" in line and 'sandbox = "insecure-allow"' in line, line
    assert "bwrap is not installed" in line and "\n" not in line, line
    pool = tool_pool(tasks)
    assert pool is not None
    with pytest.raises(ConfigError, match=r"\[tasks.tools\] runs custom rewards or tools"):
        asyncio.run(pool.start())


def test_built_in_rewards_and_the_calculator_run_without_one(no_sandbox: None) -> None:
    tasks = task_set(
        a={"source": {"type": "arithmetic"}, "episode": episode({"type": "calculator"})}
    )
    pool = tool_pool(tasks)
    assert verifier_pool(tasks).sandbox.required_by == ()
    assert pool is not None and pool.sandbox.required_by == ()


def test_insecure_allow_runs_plain_processes_never_as_root(no_sandbox: None) -> None:
    allow = {"sandbox": "insecure-allow"}
    tasks = task_set(
        custom={"source": {"type": "arithmetic"}, "reward": CUSTOM, **allow},
        tools={"source": {"type": "arithmetic"}, "episode": episode({"type": "python"}), **allow},
    )
    py = {"type": "python", "tag": "python", "description": ""}
    parts = reward_payload(tasks.specs["custom"])

    async def body() -> tuple[Any, Any]:
        pool, tools = verifier_pool(tasks), tool_pool(tasks)
        assert tools is not None
        async with pool, tools:
            assert pool.confined is False and tools.confined is False
            scored = await pool.call(R.SCORE, parts, "LOUD", None, {})
            ran = await tools.run(CALL, py, "import os\nprint(os.getuid(), len(os.environ))")
        return scored, ran

    scored, ran = asyncio.run(body())
    assert scored.error is None and scored.reward == 1.0, scored
    uid, n = (int(x) for x in ran.text.split())
    assert uid >= jail.UID_BASE if os.geteuid() == 0 else uid == os.getuid(), ran
    assert n <= len(jail.BASE_ENV) + 1, ran  # the environment is not the service's


def test_a_function_tool_sees_only_what_it_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    require_sandbox()
    monkeypatch.setenv("FLYWHEEL_NATS__PASSWORD", "hunter2")
    tool = {
        "type": "function", "tag": "env", "fn": ENV_TOOL,
        "parameters": {"name": {"type": "string"}}, "env": {"API_BASE": "http://tools.local"},
    }  # fmt: skip
    tasks = task_set(t={"source": {"type": "arithmetic"}, "episode": episode(tool)})
    spec = tasks.specs["t"].episode
    assert spec is not None
    payload = spec.tools[0].model_dump(mode="json")

    async def body() -> list[str]:
        pool = tool_pool(tasks)
        assert pool is not None
        async with pool:
            assert pool.confined
            return [
                (await pool.run(CALL, payload, f'{{"name": "{n}"}}')).text
                for n in ("API_BASE", "FLYWHEEL_NATS__PASSWORD", "API_BASE")
            ]

    declared, secret, again = asyncio.run(body())
    assert declared.startswith("API_BASE=http://tools.local count="), declared
    assert secret.startswith("FLYWHEEL_NATS__PASSWORD=None"), secret
    assert again == declared


def test_the_trainers_held_out_evaluation_runs_tools_and_rewards_in_the_sandbox(
    tmp_path: Path,
) -> None:
    """The trainer evaluates episodes with its own pools, in a container where /data is
    writable: those pools are the sandbox's too, and a tool call cannot write there."""
    require_sandbox()
    from services.trainer.heldout import HeldOut
    from services.trainer.settings import TrainerSettings

    best = tmp_path / "data" / "best.json"
    best.parent.mkdir()
    best.write_text("{}")
    task = {
        "source": {"type": "arithmetic", "size": 50},
        "reward": CUSTOM,
        "eval": {"holdout": 0.2},
        "episode": episode({"type": "python"}),
    }
    s = TrainerSettings(run="heldout-sandbox", task=task, eval_every=1, eval_on="trainer")
    py = {"type": "python", "tag": "python", "description": ""}
    code = f"open({str(best)!r}, 'w').write('pwned')"

    async def body() -> Any:
        async with HeldOut(s) as h:
            assert h.pool is not None and h.tools is not None
            assert h.pool.confined and h.tools.confined
            return await h.tools.run(CALL, py, code)

    out = asyncio.run(body())
    assert out.error == "raised", out
    assert best.read_text() == "{}"


def test_a_reward_module_under_tmp_is_visible_and_survives_the_cleaning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's module in /tmp (a run directory there): bound inside the sandbox's own
    /tmp, not hidden under it, and kept when a call's leftovers are removed."""
    require_sandbox()
    name = f"flywheel_tmp_reward_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(
        "def score(c, a):\n    return float(c == a and 'score' in open(__file__).read())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"source": {"type": "arithmetic"}, "reward": f"{name}:score"}
    tasks = task_set(t=spec)
    parts = reward_payload(tasks.specs["t"])

    async def body() -> list[float]:
        async with verifier_pool(tasks, size=1) as pool:
            assert pool.confined and str(tmp_path).startswith("/tmp/")
            return [(await pool.call(R.SCORE, parts, c, "7", {})).reward for c in "777"]

    assert asyncio.run(body()) == [1.0, 1.0, 1.0]

"""Every shipped run file loads into every service's settings (no typo survives)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.buffer.settings import BufferSettings
from services.engine.settings import EngineSettings
from services.rollout.settings import RolloutSettings
from services.runtime.settings import load_settings
from services.stack.settings import StackSettings
from services.sync.settings import SyncSettings
from services.tinker.settings import TinkerSettings
from services.trainer.settings import TrainerSettings
from tests.harness import REPO

ROOT = REPO
CONFIGS = sorted((ROOT / "configs").glob("**/*.toml"))
SETTINGS = [
    BufferSettings,
    RolloutSettings,
    TrainerSettings,
    SyncSettings,
    StackSettings,
    EngineSettings,
    TinkerSettings,
]
LOOP = frozenset({"buffer", "rollout", "trainer", "sync"})  # the RL loop's services
TASKED = LOOP - {"sync"}  # those whose settings need a [task]


def loop_free(config: Path) -> bool:
    """A run file that starts none of the RL loop's services (configs/examples/tinker.toml:
    engines and the Tinker server, the user's own loop driving them) names no task."""
    return not LOOP & set(load_settings(StackSettings, config).services)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.section)
def test_config_loads(config: Path, cls: type) -> None:
    if cls.section in TASKED and loop_free(config):  # type: ignore[attr-defined]
        pytest.skip(f"{config.name} starts no {cls.section}")  # type: ignore[attr-defined]
    s = load_settings(cls, config)
    assert s.run != "demo" or config.name == "demo.toml"


def test_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"demo.toml", "gpu-example.toml", "jsonl-math.toml",
                                        "reasoning-gym.toml"}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_names_a_task_whose_files_exist(config: Path, monkeypatch) -> None:
    """Every shipped run file of the RL loop has a task; the examples' data ships with them."""
    if loop_free(config):
        pytest.skip(f"{config.name} starts none of the loop's services: no task")
    monkeypatch.chdir(ROOT)  # the examples' paths are from the repo root, as the README runs them
    tasks = load_settings(BufferSettings, config).task_set()
    tasks.check(data=config.parent.name == "examples")

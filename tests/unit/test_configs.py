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
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.section)
def test_config_loads(config: Path, cls: type) -> None:
    s = load_settings(cls, config)
    assert s.run != "demo" or config.name == "demo.toml"


def test_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"demo.toml", "gpu-example.toml", "jsonl-math.toml",
                                        "reasoning-gym.toml"}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_names_a_task_whose_files_exist(config: Path, monkeypatch) -> None:
    """Every shipped run file has a task; the examples' data ships with them."""
    monkeypatch.chdir(ROOT)  # the examples' paths are from the repo root, as the README runs them
    tasks = load_settings(BufferSettings, config).task_set()
    tasks.check(data=config.parent.name == "examples")

"""Every shipped run file loads into every service's settings (no typo survives)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.buffer.settings import BufferSettings
from services.common.settings import load_settings
from services.rollout.engine.settings import EngineSettings
from services.rollout.settings import RolloutSettings
from services.stack.settings import StackSettings
from services.sync.settings import SyncSettings
from services.trainer.service_settings import TrainerSettings

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))
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
    assert {p.name for p in CONFIGS} >= {"demo.toml", "gpu-example.toml"}

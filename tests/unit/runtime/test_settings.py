"""Typed settings: run file + environment + overrides, with errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.runtime.errors import ConfigError
from services.runtime.settings import ServiceSettings, load_settings, render


class DemoSettings(ServiceSettings):
    section: ClassVar[str] = "demo_svc"
    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_DEMO_SVC_", env_nested_delimiter="__", extra="forbid"
    )

    lr: float = Field(1e-3, gt=0, description="Learning rate.")
    steps: int = Field(10, ge=1, description="Steps.")


RUN_FILE = """
run = "exp-1"
[nats]
url = "nats://10.0.0.1:4222"
[demo_svc]
lr = 0.5
[other]
whatever = 1
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def test_file_then_env_then_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, RUN_FILE)
    s = load_settings(DemoSettings, path)
    assert (s.run, s.lr, s.steps, s.nats.url) == ("exp-1", 0.5, 10, "nats://10.0.0.1:4222")
    monkeypatch.setenv("FLYWHEEL_DEMO_SVC_LR", "0.25")
    monkeypatch.setenv("FLYWHEEL_DEMO_SVC_NATS__URL", "nats://127.0.0.1:5000")
    s = load_settings(DemoSettings, path)
    assert (s.lr, s.nats.url) == (0.25, "nats://127.0.0.1:5000")
    assert load_settings(DemoSettings, path, lr=2.0).lr == 2.0
    assert '"lr": 0.25' in render(s)


def test_defaults_without_file() -> None:
    s = load_settings(DemoSettings)
    assert (s.run, s.lr) == ("demo", 1e-3)


def test_bad_value_names_section_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "[demo_svc]\nlr = -1\n")
    with pytest.raises(ConfigError, match=r"\[demo_svc\] lr: .*greater than 0"):
        load_settings(DemoSettings, path)


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[demo_svc]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_settings(DemoSettings, path)


def test_bad_run_name_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run"):
        load_settings(DemoSettings, write(tmp_path, 'run = "has space"\n'))
    with pytest.raises(ConfigError, match="not found"):
        load_settings(DemoSettings, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(DemoSettings, write(tmp_path, "[demo_svc\n"))


def test_print_config_masks_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_DEMO_SVC_NATS__PASSWORD", "hunter2")
    monkeypatch.setenv("FLYWHEEL_DEMO_SVC_NATS__TOKEN", "s3cr3t")
    s = load_settings(DemoSettings)
    text = render(s)
    assert "hunter2" not in text and "s3cr3t" not in text and "**********" in text
    assert s.nats.password is not None and s.nats.password.get_secret_value() == "hunter2"

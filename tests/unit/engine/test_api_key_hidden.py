"""The engine API key reaches the engine by environment or file, never on a command line.

`ps` shows every user each process's command line; SGLang takes its key only
as `--api-key`. keyed_launch adds it inside the process. A real subprocess:
the module it runs sees the key in sys.argv, the process's /proc cmdline does
not hold it, nor does the environment it passes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.cli import parser, settings_from
from services.runtime.errors import ConfigError
from tests.harness import REPO

ECHO = "tests.unit.engine.argv_echo"


def _launch(env: dict[str, str], *args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "services.engine_api.keyed_launch", ECHO, "--port", "1", *args],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=True,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), **env},
    )  # fmt: skip
    return dict(json.loads(out.stdout.splitlines()[-1]))


def test_the_key_from_the_environment_is_in_argv_but_not_on_the_command_line() -> None:
    got = _launch({"FLYWHEEL_ENGINE_API_KEY": "sk-env-1234"})
    assert got["argv"] == ["--port", "1", "--api-key", "sk-env-1234"]
    assert not any("sk-env-1234" in part for part in got["cmdline"])  # type: ignore[attr-defined]
    assert got["env_key"] is None  # not passed on to what it starts


def test_the_key_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("sk-file-5678\n")
    got = _launch({"FLYWHEEL_ENGINE_API_KEY_FILE": str(tmp_path / "key")})
    assert got["argv"][-2:] == ["--api-key", "sk-file-5678"]  # type: ignore[index]
    assert not any("sk-file" in part for part in got["cmdline"])  # type: ignore[attr-defined]


def test_no_key_adds_nothing() -> None:
    assert _launch({})["argv"] == ["--port", "1"]


def test_the_cpu_engine_takes_its_key_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("sk-cpu\n")
    s = settings_from(
        parser().parse_args(["--model", "/m", "--api-key-file", str(tmp_path / "key")])
    )
    assert s.api_key is not None and s.api_key.get_secret_value() == "sk-cpu"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        settings_from(
            parser().parse_args(["--model", "/m", "--api-key-file", str(tmp_path / "empty")])
        )


def test_the_cpu_engine_takes_its_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_ENGINE_API_KEY", "sk-cpu-env")
    s = settings_from(parser().parse_args(["--model", "/m"]))
    assert s.api_key is not None and s.api_key.get_secret_value() == "sk-cpu-env"

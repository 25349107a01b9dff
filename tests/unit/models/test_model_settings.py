"""The engine's and tinker's start-up share one reading of their settings and model
(services/models/resolve.py `model_settings`): the same exits and one-line reasons."""

from __future__ import annotations

import pytest

from services.engine.cli import main as engine_main
from services.tinker.cli import main as tinker_main

MAINS = {"engine": engine_main, "tinker": tinker_main}


@pytest.mark.parametrize("section", list(MAINS))
def test_each_service_says_why_it_cannot_start(section, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(f"FLYWHEEL_{section.upper()}_MODEL", raising=False)
    main = MAINS[section]
    assert main([]) == 2
    assert f"error: no model directory (--model or [{section}] model)" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert f"[{section}] model = " in err and "no such model directory" in err
    assert len(err.strip().splitlines()) == 1
    bad = tmp_path / "run.toml"
    bad.write_text(f"[{section}]\nno_such_key = 1\n")
    assert main(["-c", str(bad)]) == 2
    assert "no_such_key" in capsys.readouterr().err


@pytest.mark.parametrize("section", list(MAINS))
def test_print_config_needs_no_model(section, capsys):
    assert MAINS[section](["--print-config"]) == 0
    assert '"model": null' in capsys.readouterr().out

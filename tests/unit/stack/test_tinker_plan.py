"""`flywheel up` with the Tinker server (`[stack] services` has "tinker"): it starts after
the engines and samples on them; a Tinker-only run file starts nothing else; preflight
refuses engines without LoRA beside it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from services.runtime.settings import load_settings
from services.stack.cli import dry_run, preflight
from services.stack.plan import plan
from services.stack.settings import StackSettings

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "configs" / "examples" / "tinker.toml"
PORTS = itertools.count(23000)


def _example(tmp_path: Path, text: str | None = None) -> tuple[StackSettings, Path]:
    path = tmp_path / "tinker.toml"
    path.write_text((text or EXAMPLE.read_text()).replace('"runs/tinker"', f'"{tmp_path}"'))
    return load_settings(StackSettings, path), path


def test_the_example_starts_an_engine_and_the_tinker_server_on_it(tmp_path: Path) -> None:
    s, path = _example(tmp_path)
    specs = plan(s, path, "nats://x:1", lambda: next(PORTS))
    assert [p.kind for p in specs] == ["engine", "tinker"]  # no rollout, sync, trainer, buffer
    engine, tinker = specs
    assert tinker.argv[-4:] == ("--port", "8000", "--model", str(s.model))
    assert tinker.ready_url == "http://127.0.0.1:8000/api/v1/healthz"
    urls = json.loads(tinker.env["FLYWHEEL_TINKER_ENGINES"])
    assert urls == [(engine.ready_url or "").removesuffix("/health_generate")]
    assert tinker.env["FLYWHEEL_TINKER_STATE_DIR"] == str(tmp_path.resolve() / "tinker-state")
    assert dry_run(s, path).startswith("nats: none")  # nothing here uses NATS


def test_port_zero_model_and_state_dir_of_the_tinker_table(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("port = 8000 ", "port = 0 ")
    text += f'model = "{tmp_path / "other"}"\nstate_dir = "{tmp_path / "states"}"\n'
    s, path = _example(tmp_path, text)
    (tinker,) = [p for p in plan(s, path, "nats://x:1", lambda: 23999) if p.kind == "tinker"]
    assert tinker.argv[-2:] == ("--port", "23999")  # a free port; the table's model is read
    assert tinker.ready_url == "http://127.0.0.1:23999/api/v1/healthz"
    assert "FLYWHEEL_TINKER_STATE_DIR" not in tinker.env  # the table's own


def test_beside_a_whole_run_and_pinned(tmp_path: Path) -> None:
    s = StackSettings(
        run_dir=tmp_path,
        engines=2,
        task={"source": {"type": "arithmetic"}},
        services=("engine", "rollout", "sync", "trainer", "buffer", "tinker"),
        cpus={"tinker": [0]},
    )
    (tmp_path / "r.toml").write_text("")
    specs = plan(s, tmp_path / "r.toml", "nats://x:1", lambda: next(PORTS))
    kinds = [p.kind for p in specs]
    assert kinds.index("tinker") == 2  # after the engines, before the rest
    tinker = specs[2]
    assert len(json.loads(tinker.env["FLYWHEEL_TINKER_ENGINES"])) == 2
    assert tinker.cpus == (0,) and tinker.env["FLYWHEEL_TINKER_NUM_THREADS"] == "1"


def test_preflight_wants_lora_on_the_engines_beside_it(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    s, path = _example(tmp_path)
    assert preflight(s, str(path), data=False) == 0, capsys.readouterr().err
    s, path = _example(tmp_path, EXAMPLE.read_text().replace("enable_lora = true", ""))
    assert preflight(s, str(path), data=False) != 0
    assert "need [engine] enable_lora = true" in capsys.readouterr().err

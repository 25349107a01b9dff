"""`[stack] placement`: what a colocated run gives its roles, and the engine idle figure."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.stack.plan import plan
from services.stack.settings import StackSettings
from services.stack.status import parse, render_line, summarise

PORTS = itertools.count(21000)


def specs_of(s: StackSettings, tmp_path: Path) -> dict[str, dict[str, str]]:
    return {
        p.name: p.env for p in plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS))
    }


def test_colocated_gives_the_trainer_and_every_worker_the_runs_lease(tmp_path: Path) -> None:
    s = StackSettings(run_dir=tmp_path, placement="colocated", engines=2, engine_threads=1)
    env = specs_of(s, tmp_path)
    lease = str(tmp_path.resolve() / "cores")
    assert env["trainer"]["FLYWHEEL_TRAINER_CORES__DIR"] == lease
    for w in ("rollout-0", "rollout-1"):
        assert env[w]["FLYWHEEL_ROLLOUT_CORES__DIR"] == lease
        assert env[w]["FLYWHEEL_ROLLOUT_CORES__SHARE"] == "1"
    assert env["engine-0"]["FLYWHEEL_ENGINE_NUM_THREADS"] == "1"  # its share, to start with


def test_disaggregated_lends_nothing(tmp_path: Path) -> None:
    env = specs_of(StackSettings(run_dir=tmp_path, placement="disaggregated"), tmp_path)
    assert not any("CORES__" in k for e in env.values() for k in e)


def test_auto_colocates_a_cpu_run_on_a_small_machine_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert not StackSettings(run_dir=tmp_path).colocated  # the default: disaggregated
    auto = {"run_dir": tmp_path, "placement": "auto"}
    assert StackSettings(**auto).colocated
    assert not StackSettings(**auto, trainer_nproc=2).colocated
    assert not StackSettings(**auto, cpus={"trainer": [0]}).colocated
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert not StackSettings(**auto).colocated


def test_colocated_refuses_what_it_cannot_lend(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="SGLang"):
        StackSettings(run_dir=tmp_path, placement="colocated", engine="sglang",
                      engine_gpus=[[0]], engines=1)  # fmt: skip
    with pytest.raises(ValidationError, match="drop `cpus`"):
        StackSettings(run_dir=tmp_path, placement="colocated", cpus={"trainer": [0]})


def test_status_line_shows_the_engines_idle_share() -> None:
    rollout = "flywheel_rollout_engine_idle_fraction {}\n"
    now = summarise(
        {"rollout-0": parse(rollout.format(0.1)), "rollout-1": parse(rollout.format(0.3))}
    )
    assert "engine idle 20%" in render_line(now, None)
    assert "engine idle - |" in render_line(summarise({}), None)

"""The pure parts of `flywheel replay`: task ids, --set, --reward, version comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.replay.compare import compare_version
from services.replay.rescore import reward_value
from services.replay.retrain import set_env
from services.replay.samples import parse_task_id
from services.runtime.errors import ConfigError


def test_task_ids_give_back_the_buffers_epoch_and_position() -> None:
    assert parse_task_id("demo:e3:i17") == (3, 17)
    assert parse_task_id("run-with-dashes:e0:i0") == (0, 0)
    assert parse_task_id("demo:3:17") is None
    assert parse_task_id("something-else") is None


def test_set_becomes_a_trainer_environment_override() -> None:
    assert set_env(["optim.lr=1e-5", "loss.kl_coef=0.01"]) == {
        "FLYWHEEL_TRAINER_OPTIM__LR": "1e-5",
        "FLYWHEEL_TRAINER_LOSS__KL_COEF": "0.01",
    }
    with pytest.raises(ConfigError, match="key=value"):
        set_env(["optim.lr"])


def test_reward_takes_a_toml_value_or_a_bare_name() -> None:
    assert reward_value("math") == "math"
    assert reward_value('"exact_match"') == "exact_match"
    assert reward_value('{fn = "format", pattern = "x"}') == {"fn": "format", "pattern": "x"}


def write(d: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Path:
    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"), metadata=meta)
    return d


def test_versions_compare_by_bytes_then_by_tensors(tmp_path: Path) -> None:
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    run = write(tmp_path / "run", a)
    same = compare_version(1, run, write(tmp_path / "same", a))
    assert same.bytes_equal and same.tensors_equal and "identical" in same.line()
    meta = compare_version(1, run, write(tmp_path / "meta", a, {"format": "pt", "x": "1"}))
    assert not meta.bytes_equal and meta.tensors_equal and "metadata" in meta.line()
    moved = {**a, "w": a["w"] + 0.5}
    diff = compare_version(1, run, write(tmp_path / "moved", moved))
    assert not diff.tensors_equal and diff.differing == ["w"] and diff.max_abs_diff == 0.5
    assert "differs: 1 tensors" in diff.line()
    gone = compare_version(1, run, tmp_path / "nothing")
    assert gone.missing is not None and "not compared" in gone.line()

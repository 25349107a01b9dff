"""`flywheel up` refuses a run whose trainer cannot write its first step's checkpoint and
weights, and warns where the steady state would not fit (services/stack/diskplan.py).

A model directory's size is what the plan reads: a sparse safetensors file of a given
length stands in for a model that large, so the filesystem's real free space is short of
it without writing anything.
"""

import json
from pathlib import Path

from services.runtime.diskroom import free_bytes
from services.runtime.settings import load_settings
from services.stack.cli import preflight
from services.stack.diskplan import DiskPlan, plan_for, shortfalls
from services.stack.settings import StackSettings

REPO = Path(__file__).resolve().parents[3]
DEMO_REAL = REPO / "configs" / "demo-real.toml"


def model_of(tmp_path: Path, size: int, dtype: str = "bfloat16") -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": dtype}))
    with (d / "model.safetensors").open("wb") as f:
        f.truncate(size)  # sparse: no blocks
    return d


def test_the_plan_is_twelve_bytes_a_parameter_and_the_stored_weights(tmp_path):
    # SmolLM2-135M as make smollm2 imports it: 269,060,552 bytes of bf16
    plan = plan_for(model_of(tmp_path, 269_060_552), keep_checkpoints=2, keep_versions=3)
    assert plan == DiskPlan(134_530_276 * 12, 269_060_552, 2, 3)
    assert plan.first() == (1_614_363_312, 269_060_552)
    assert plan.steady() == (3 * 1_614_363_312, 4 * 269_060_552)
    assert plan_for(tmp_path, 2, 3) is None  # no config.json: nothing to go on


def test_shortfalls_against_the_real_free_space(tmp_path):
    free = free_bytes(tmp_path)
    a, b = tmp_path / "ckpt", tmp_path / "weights"
    assert shortfalls(DiskPlan(1 << 20, 1 << 20, 2, 3), a, b) == ([], [])
    errors, warnings = shortfalls(DiskPlan(free + (1 << 30), 1 << 20, 2, 3), a, b)
    assert len(errors) == 1 and not warnings
    assert "checkpoint_dir and weights_root" in errors[0] and "first step" in errors[0]
    # one checkpoint fits, the three kept while a fourth is written do not
    errors, warnings = shortfalls(DiskPlan(free // 3, 1 << 20, 3, 3), a, b)
    assert not errors and len(warnings) == 1 and "3 checkpoints" in warnings[0]


def test_up_refuses_a_model_the_disk_cannot_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the run file's data paths
    huge = model_of(tmp_path, free_bytes(tmp_path))  # its checkpoint: 6x the free space
    text = DEMO_REAL.read_text().replace(
        'model = "~/.cache/flywheel/models/SmolLM2-135M-Instruct"', f'model = "{huge}"'
    )
    ckpt = f'[trainer]\ncheckpoint_dir = "{tmp_path / "c"}"\n'
    run = tmp_path / "run.toml"
    run.write_text(text.replace("[trainer]\n", ckpt, 1))
    assert preflight(load_settings(StackSettings, run), str(run)) != 0
    assert "the first step's checkpoint and weights need" in capsys.readouterr().err
    # the same run file on a model the disk holds passes
    (tmp_path / "s").mkdir()
    run.write_text(run.read_text().replace(str(huge), str(model_of(tmp_path / "s", 1 << 20))))
    assert preflight(load_settings(StackSettings, run), str(run)) == 0, capsys.readouterr().err

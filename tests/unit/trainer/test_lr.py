"""`optim.lr = "auto"`: the closed form, its clamps, LoRA's 10x, and the setting itself."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from services.runtime.settings import load_settings, render
from services.trainer.core.lr import auto_lr, describe_auto_lr, resolve_lr
from services.trainer.settings import OptimConfig, SftSettings, TrainerSettings

SMOLLM2_135M = 134_515_008  # counted from its model.safetensors header (tied head once)
TASK = '[task]\nsource = { type = "arithmetic", digits = 1 }\n'


def closed_form(n: float, scale: float) -> float:
    return min(max(scale * 4e-5 * math.sqrt(1.35e8 / n), scale * 1e-6), scale * 4e-5)


@pytest.mark.parametrize("n", [3.62e8, 4.94e8, 1.71e9, 7e9, 7e10])
@pytest.mark.parametrize("lora", [False, True])
def test_auto_is_the_closed_form_between_the_clamps(n: float, lora: bool) -> None:
    want = (10 if lora else 1) * 4e-5 * math.sqrt(1.35e8 / n)
    assert auto_lr(int(n), lora=lora) == pytest.approx(want, rel=1e-9)
    assert auto_lr(int(n), lora=lora) == pytest.approx(closed_form(n, 10 if lora else 1))


def test_the_documented_figures() -> None:
    assert auto_lr(int(1.35e8), lora=False) == pytest.approx(4e-5)
    assert auto_lr(int(1.71e9), lora=False) == pytest.approx(1.124e-5, rel=1e-3)
    assert auto_lr(int(7e9), lora=False) == pytest.approx(5.555e-6, rel=1e-3)
    assert auto_lr(int(7e10), lora=False) == pytest.approx(1.757e-6, rel=1e-3)
    assert auto_lr(int(7e9), lora=True) == pytest.approx(5.555e-5, rel=1e-3)


@pytest.mark.parametrize("lora", [False, True])
def test_the_clamps(lora: bool) -> None:
    top, floor = (4e-4, 1e-5) if lora else (4e-5, 1e-6)
    # smaller than the anchor (SmolLM2-135M itself is just under 1.35e8), the tests' tiny
    # models: the measured rate, not a larger one
    for n in (1, 530_000, 5_000_000, SMOLLM2_135M):
        assert auto_lr(n, lora=lora) == top
    # larger than 1.35e8 · 40² = 216B parameters: the floor
    for n in (int(2.16e11), int(1e12), int(1e15)):
        assert auto_lr(n, lora=lora) == pytest.approx(floor)
    assert auto_lr(int(2.1e11), lora=lora) > floor


def test_lora_is_ten_times_full_fine_tuning() -> None:
    for n in (10**6, SMOLLM2_135M, 10**9, 10**10, 10**12):
        assert auto_lr(n, lora=True) == pytest.approx(10 * auto_lr(n, lora=False))


def test_an_explicit_number_always_wins() -> None:
    assert resolve_lr(1e-6, SMOLLM2_135M, lora=False) == 1e-6
    assert resolve_lr(3e-3, 10**12, lora=True) == 3e-3
    assert resolve_lr("auto", SMOLLM2_135M, lora=False) == 4e-5
    assert resolve_lr("auto", SMOLLM2_135M, lora=True) == 4e-4
    with pytest.raises(ValueError, match="positive"):
        auto_lr(0, lora=False)


def test_the_start_up_line() -> None:
    line = describe_auto_lr(4e-5, SMOLLM2_135M, lora=False, section="trainer.optim")
    assert line == (
        "lr auto -> 4.0e-05 (134.5M parameters, full fine-tuning); "
        "set [trainer.optim] lr to override"
    )
    assert "LoRA" in describe_auto_lr(4e-4, SMOLLM2_135M, lora=True, section="sft.optim")


def test_the_setting_takes_auto_or_a_positive_number(tmp_path, monkeypatch) -> None:
    assert OptimConfig().lr == "auto"
    assert OptimConfig(lr=1e-5).lr == 1e-5
    for bad in (0, -1e-5, "fast"):
        with pytest.raises(ValidationError):
            OptimConfig(lr=bad)
    run = tmp_path / "run.toml"
    run.write_text(TASK + "[trainer.optim]\nlr = 2e-5\n")
    assert load_settings(TrainerSettings, run).optim.lr == 2e-5
    run.write_text(TASK + '[trainer.optim]\nlr = "auto"\n')
    assert load_settings(TrainerSettings, run).optim.lr == "auto"
    # the environment (and so `flywheel replay train --set optim.lr=...`) reaches it too
    monkeypatch.setenv("FLYWHEEL_TRAINER_OPTIM__LR", "1e-5")
    assert load_settings(TrainerSettings, run).optim.lr == 1e-5
    monkeypatch.setenv("FLYWHEEL_TRAINER_OPTIM__LR", "auto")
    run.write_text(TASK + "[trainer.optim]\nlr = 2e-5\n")
    assert load_settings(TrainerSettings, run).optim.lr == "auto"


def test_print_config_shows_auto(tmp_path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(TASK)
    doc = json.loads(render(load_settings(TrainerSettings, run)))
    assert doc["optim"]["lr"] == "auto"
    # SFT keeps its own default, a number; a table of its own without lr: the field's
    assert load_settings(SftSettings, run).optim.lr == 1e-4
    run.write_text(TASK + "[sft.optim]\nwarmup_steps = 5\n")
    assert load_settings(SftSettings, run).optim.lr == "auto"

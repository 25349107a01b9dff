"""`optim.lr = "auto"` on a loaded model: resolved from the model's own parameter count
(the base model's with LoRA), used by the optimizer, the schedule and the metrics, and
said once at start-up by the trainer service."""

from __future__ import annotations

import logging

import pytest

from services.runtime.settings import load_settings
from services.trainer.app import load_trainer
from services.trainer.core.lr import auto_lr
from services.trainer.distributed import DistInfo
from services.trainer.model import load_model
from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig, TrainerSettings
from services.trainer.trainer import Trainer, parameter_count
from services.weights.adapter import LoraSettings
from tests.integration.trainer.trainer_helpers import random_batch

FP32 = ModelConfig(precision="fp32")


def test_auto_is_resolved_from_the_whole_model_and_used_everywhere(tiny_model_dir):
    n = sum(p.numel() for p in load_model(tiny_model_dir).parameters())
    assert 100_000 < n < 10_000_000  # a tiny model: below the anchor, so the top clamp
    t = Trainer.from_pretrained(tiny_model_dir, TrainConfig(model=FP32))  # optim: defaults
    assert t.n_params == n and t.lr == auto_lr(n, lora=False) == 4e-5
    assert t.optimizer.param_groups[0]["lr"] == 4e-5
    assert t.train_step(random_batch(seed=1))["lr"] == 4e-5
    note = t.auto_lr_note("trainer.optim")
    assert note is not None and note.startswith(f"lr auto -> 4.0e-05 ({n / 1e6:.1f}M param")


def test_the_schedule_runs_from_the_resolved_lr(tiny_model_dir):
    optim = OptimConfig(warmup_steps=4, schedule="cosine", total_steps=8)
    t = Trainer.from_pretrained(tiny_model_dir, TrainConfig(optim=optim, model=FP32))
    lrs = [t.train_step(random_batch(seed=s))["lr"] for s in range(2)]
    assert lrs == pytest.approx([4e-5 * 1 / 4, 4e-5 * 2 / 4])


def test_lora_resolves_from_the_base_models_count_at_ten_times(tiny_model_dir):
    cfg = TrainConfig(model=FP32, lora=LoraSettings(rank=4, alpha=8))
    t = Trainer.from_pretrained(tiny_model_dir, cfg)
    base = parameter_count(load_model(tiny_model_dir))
    assert parameter_count(t.model) > base  # the adapter's parameters are not counted
    assert t.n_params == base and t.lr == 4e-4
    assert t.optimizer.param_groups[0]["lr"] == 4e-4
    assert "LoRA" in (t.auto_lr_note("trainer.optim") or "")


def test_a_number_in_the_run_file_wins_and_nothing_is_said(tiny_model_dir):
    t = Trainer.from_pretrained(tiny_model_dir, TrainConfig(optim=OptimConfig(lr=1e-6)))
    assert t.lr == 1e-6 and t.optimizer.param_groups[0]["lr"] == 1e-6
    assert t.auto_lr_note("trainer.optim") is None


def test_the_trainer_service_says_what_auto_became(tiny_model_dir, tmp_path, caplog):
    run = tmp_path / "run.toml"
    run.write_text(
        '[task]\nsource = { type = "arithmetic", digits = 1 }\n'
        f'[trainer]\ncheckpoint_dir = "{tmp_path / "ckpt"}"\n'
        '[trainer.runtime]\nprecision = "fp32"\n'
    )
    s = load_settings(TrainerSettings, run, model=tiny_model_dir)
    with caplog.at_level(logging.INFO, logger="services.trainer.app"):
        trainer, _ = load_trainer(s, DistInfo())
    lines = [r.getMessage() for r in caplog.records if "lr auto" in r.getMessage()]
    assert lines == [
        f"trainer: lr auto -> 4.0e-05 ({trainer.n_params / 1e6:.1f}M parameters, "
        "full fine-tuning); set [trainer.optim] lr to override"
    ]

"""`flywheel demo --seed N`: one number reaches every seed of the RL run, and changes it."""

from __future__ import annotations

from pathlib import Path

from services.buffer.core import epoch_order
from services.buffer.settings import BufferSettings
from services.engine.settings import EngineSettings
from services.runtime.settings import load_settings
from services.stack.demo import parse_args, run_file
from services.stack.demo_real import CONFIG
from services.trainer.settings import TrainerSettings


def test_the_seed_reaches_the_buffer_the_engines_and_the_trainer(tmp_path: Path) -> None:
    args = parse_args(["--task", "real", "--seed", "3"])
    rf = run_file(CONFIG, tmp_path, tmp_path / "model", None, None, args.seed)
    assert load_settings(BufferSettings, rf).seed == 3
    assert load_settings(EngineSettings, rf).random_seed == 3
    trainer = load_settings(TrainerSettings, rf)
    assert trainer.runtime.seed == 3
    base = load_settings(TrainerSettings, CONFIG)
    assert trainer.optim == base.optim and trainer.loss == base.loss  # the rest untouched


def test_without_a_seed_the_run_file_keeps_its_own(tmp_path: Path) -> None:
    assert parse_args(["--task", "real"]).seed is None
    rf = run_file(CONFIG, tmp_path, tmp_path / "model", None, None, None)
    assert load_settings(BufferSettings, rf).seed == 0
    assert load_settings(EngineSettings, rf).random_seed == 0


def test_another_seed_is_another_prompt_order() -> None:
    assert epoch_order(0, 0, 1000) != epoch_order(1, 0, 1000)
    assert epoch_order(1, 0, 1000) == epoch_order(1, 0, 1000)

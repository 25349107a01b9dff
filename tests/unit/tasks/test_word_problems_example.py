"""The word-problems example on the real model (configs/examples/word-problems.toml): its
held-out split never meets training, its learning keys are the defaults, and its reward
(by import path) reads the reply's last number against the text after `####`."""

from __future__ import annotations

from pathlib import Path

from configs.examples.word_problems import final_number
from services.buffer.settings import BufferSettings
from services.runtime.settings import load_settings
from services.stack.settings import StackSettings
from services.tasks.rewards import score
from services.tasks.scoring import reward_payload
from services.trainer.settings import TrainerSettings

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "examples" / "word-problems.toml"


def test_the_held_out_questions_are_never_trained_on() -> None:
    loaded = load_settings(StackSettings, CONFIG).task_set().load(eval_size=400)["jsonl"]
    train = {loaded.rows.row(i).prompt for i in loaded.train}
    validation = {row.prompt for _, row in loaded.validation}
    test = {row.prompt for _, row in loaded.test}
    assert train and validation and test
    assert not train & validation and not train & test and not validation & test
    # a quarter of the file's 400 questions held back, about half of them test
    held = len(validation) + len(test)
    assert 60 <= held <= 140 and len(train) + held == 400


def test_the_learning_keys_are_the_defaults() -> None:
    buffer = load_settings(BufferSettings, CONFIG)
    trainer = load_settings(TrainerSettings, CONFIG)
    assert buffer.temperature == BufferSettings.model_fields["temperature"].default
    assert buffer.samples_per_prompt == BufferSettings.model_fields["samples_per_prompt"].default
    assert trainer.optim == type(trainer.optim)() and trainer.loss == type(trainer.loss)()


def test_the_reply_s_last_number_is_its_answer() -> None:
    assert final_number("16 - 2 = 14, so 14 cards are left.", "14") == 1.0
    assert final_number("14", "14") == 1.0 and final_number("It is 1,400.", "1400") == 1.0
    assert final_number("14 cards, then 2 more: 16.", "14") == 0.0  # the last number counts
    assert final_number("Gus has some cards left.", "14") == 0.0
    assert final_number("14", None) == 0.0 and final_number("14", "fourteen") == 0.0


def test_the_reward_as_the_workers_call_it() -> None:
    spec = load_settings(StackSettings, CONFIG).task_set().specs["jsonl"]
    row = spec.source.model_dump()  # the answer the workers hand it: after "####"
    assert row["answer_marker"] == "####"
    parts = reward_payload(spec)
    assert score(parts, "2 * 7 = 14 pencils.", "14", {"row": 0})["reward"] == 1.0
    assert score(parts, "They have 12 pencils.", "14", {"row": 0})["reward"] == 0.0

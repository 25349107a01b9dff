"""The review-sentiment example (configs/examples/review-sentiment.toml): held-out reviews
never occur in training, the files are what the generator writes, the reward reads a reply."""

from __future__ import annotations

import json
from pathlib import Path

from configs.examples.review_sentiment import LABELS, TEMPLATES, reviews, sentiment_reward, split_of
from services.buffer.settings import BufferSettings
from services.runtime.settings import load_settings
from services.stack.settings import StackSettings
from services.tasks.rewards import score
from services.tasks.scoring import reward_payload
from services.trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "examples" / "review-sentiment.toml"
DATA = ROOT / "configs" / "examples" / "data"


def read(split: str) -> list[dict[str, str]]:
    path = DATA / f"reviews-{split}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_the_files_are_disjoint_and_each_review_is_in_its_hash_split() -> None:
    files = {s: read(s) for s in ("train", "val", "test")}
    texts = {s: {r["review"] for r in rows} for s, rows in files.items()}
    assert not texts["train"] & texts["val"] and not texts["train"] & texts["test"]
    assert not texts["val"] & texts["test"]
    for split, rows in files.items():
        assert all(split_of(r["review"]) == split for r in rows)
        assert {r["sentiment"] for r in rows} == set(LABELS)
    assert files["test"] == reviews("test", len(files["test"]))  # the generator's output


def test_a_review_never_names_its_sentiment() -> None:
    for rows in (read("train"), read("test")):
        for r in rows:
            words = set(r["review"].lower().replace(",", " ").replace(".", " ").split())
            assert not words & set(LABELS), r
    assert all(len(v) == 8 for v in TEMPLATES.values())


def test_the_run_file_trains_validates_and_tests_on_disjoint_splits() -> None:
    tasks = load_settings(StackSettings, CONFIG).task_set()
    loaded = tasks.load(eval_size=300)["jsonl"]
    train = {loaded.rows.row(i).prompt for i in loaded.train}
    validation = {row.prompt for _, row in loaded.validation}
    test = {row.prompt for _, row in loaded.test}
    assert len(train) == 2000 and len(validation) == 150 and len(test) == 300
    assert not train & validation and not train & test and not validation & test


def test_the_learning_keys_are_the_defaults() -> None:
    buffer, trainer = load_settings(BufferSettings, CONFIG), load_settings(TrainerSettings, CONFIG)
    assert buffer.temperature == BufferSettings.model_fields["temperature"].default
    assert buffer.samples_per_prompt == BufferSettings.model_fields["samples_per_prompt"].default
    assert trainer.optim == type(trainer.optim)()  # lr, schedule, clip: all the defaults
    assert trainer.loss == type(trainer.loss)()


def test_the_reward_pays_the_right_sentiment_named_alone() -> None:
    assert sentiment_reward("Negative.", "negative") == 1.0
    assert sentiment_reward("This product review is negative.", "negative") == 1.0
    assert sentiment_reward("positive or negative", "negative") == 0.0  # the question echoed
    assert sentiment_reward("This product review is positive.", "negative") == 0.0
    assert sentiment_reward("I cannot tell.", "positive") == 0.0
    assert sentiment_reward("Positive", None) == 0.0
    spec = load_settings(StackSettings, CONFIG).task_set().specs["jsonl"]
    parts = reward_payload(spec)
    assert score(parts, "Positive", "positive", {"row": 0})["reward"] == 1.0
    assert score(parts, "Negative", "positive", {"row": 0})["reward"] == 0.0

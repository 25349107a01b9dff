"""The user-task examples on the real model (configs/examples/ticket-routing.toml and
review-sentiment.toml): held-out rows never occur in training, the files are what the
generators write, every learning key is the default, each reward reads a reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from configs.examples import review_sentiment, ticket_routing
from services.buffer.settings import BufferSettings
from services.runtime.settings import load_settings
from services.stack.settings import StackSettings
from services.tasks.rewards import score
from services.tasks.scoring import reward_payload
from services.trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "configs" / "examples" / "data"


@dataclass(frozen=True)
class Example:
    config: str  # under configs/examples
    files: str  # the data files' prefix under configs/examples/data
    text: str  # the prompt field
    label: str  # the answer field
    labels: tuple[str, ...]
    templates: dict[str, tuple[str, ...]]
    split_of: Callable[[str], str]
    rows: Callable[..., list[dict[str, str]]]


EXAMPLES = {
    "tickets": Example("ticket-routing.toml", "tickets", "ticket", "department",
                       ticket_routing.DEPARTMENTS, ticket_routing.ISSUES, ticket_routing.split_of,
                       ticket_routing.tickets),
    "reviews": Example("review-sentiment.toml", "reviews", "review", "sentiment",
                       review_sentiment.LABELS, review_sentiment.TEMPLATES,
                       review_sentiment.split_of, review_sentiment.reviews),
}  # fmt: skip


@pytest.fixture(params=list(EXAMPLES))
def ex(request: pytest.FixtureRequest) -> Example:
    return EXAMPLES[request.param]


def read(ex: Example, split: str) -> list[dict[str, str]]:
    path = DATA / f"{ex.files}-{split}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def config(ex: Example) -> Path:
    return ROOT / "configs" / "examples" / ex.config


def test_the_files_are_disjoint_and_each_row_is_in_its_hash_split(ex: Example) -> None:
    files = {s: read(ex, s) for s in ("train", "val", "test")}
    texts = {s: {r[ex.text] for r in rows} for s, rows in files.items()}
    assert not texts["train"] & texts["val"] and not texts["train"] & texts["test"]
    assert not texts["val"] & texts["test"]
    for split, rows in files.items():
        assert all(ex.split_of(r[ex.text]) == split for r in rows)
        assert {r[ex.label] for r in rows} == set(ex.labels)
    assert files["test"] == ex.rows("test", len(files["test"]))  # the generator's output


def test_a_row_never_names_its_label(ex: Example) -> None:
    for rows in (read(ex, "train"), read(ex, "test")):
        for r in rows:
            words = set(r[ex.text].lower().replace(",", " ").replace(".", " ").split())
            assert not words & set(ex.labels), r
    assert set(ex.templates) == set(ex.labels) and all(len(v) >= 6 for v in ex.templates.values())


def test_the_run_file_trains_validates_and_tests_on_disjoint_splits(ex: Example) -> None:
    tasks = load_settings(StackSettings, config(ex)).task_set()
    loaded = tasks.load(eval_size=300)["jsonl"]
    train = {loaded.rows.row(i).prompt for i in loaded.train}
    validation = {row.prompt for _, row in loaded.validation}
    test = {row.prompt for _, row in loaded.test}
    assert len(train) == 2000 and len(validation) == 150 and len(test) == 300
    assert not train & validation and not train & test and not validation & test


def test_the_learning_keys_are_the_defaults(ex: Example) -> None:
    buffer = load_settings(BufferSettings, config(ex))
    trainer = load_settings(TrainerSettings, config(ex))
    assert buffer.temperature == BufferSettings.model_fields["temperature"].default
    assert buffer.samples_per_prompt == BufferSettings.model_fields["samples_per_prompt"].default
    assert trainer.optim == type(trainer.optim)()  # lr, schedule, clip: all the defaults
    assert trainer.loss == type(trainer.loss)()


def test_the_reward_as_the_workers_call_it(ex: Example) -> None:
    parts = reward_payload(load_settings(StackSettings, config(ex)).task_set().specs["jsonl"])
    right, wrong = ex.labels[0], ex.labels[1]
    assert score(parts, right.capitalize(), right, {"row": 0})["reward"] == 1.0
    assert score(parts, wrong.capitalize(), right, {"row": 0})["reward"] == 0.0


def test_the_department_named_alone_pays() -> None:
    reward = ticket_routing.department_reward
    assert reward("Shipping.", "shipping") == 1.0
    assert reward("This goes to the shipping department.", "shipping") == 1.0
    assert reward("billing or shipping", "shipping") == 0.0
    assert reward("Shipping. The shipping team will help.", "shipping") == 1.0
    listed = "Route this customer message to one department: billing, shipping, returns or tec"
    assert reward(listed, "billing") == 0.0  # the prompt echoed: no department chosen
    assert reward("I'm sorry, I cannot help.", "returns") == 0.0
    assert reward("return", "returns") == 0.0


def test_the_sentiment_named_alone_pays() -> None:
    reward = review_sentiment.sentiment_reward
    assert reward("Negative.", "negative") == 1.0
    assert reward("This product review is negative.", "negative") == 1.0
    assert reward("positive or negative", "negative") == 0.0  # the question echoed
    assert reward("This product review is positive.", "negative") == 0.0
    assert reward("I cannot tell.", "positive") == 0.0
    assert reward("Positive", None) == 0.0

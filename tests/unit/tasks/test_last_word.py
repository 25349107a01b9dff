"""The real-model demo's task: held-out lists never occur in training; the reward's shape."""

from __future__ import annotations

from services.runtime.settings import load_settings
from services.stack.demo_real import CONFIG
from services.stack.settings import StackSettings
from services.tasks.last_word import brevity_credit, rows, split_of
from services.tasks.rewards import score
from services.tasks.scoring import reward_payload


def test_held_out_prompts_never_occur_in_training() -> None:
    train = rows("train", 20_000)
    val, test = rows("val", 200), rows("test", 200)
    prompts = {r["prompt"] for r in train}
    assert not prompts & {r["prompt"] for r in val}
    assert not prompts & {r["prompt"] for r in test}
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in test}
    assert len({r["prompt"] for r in test}) == 200  # held-out rows are distinct lists


def test_the_split_is_a_function_of_the_list_alone() -> None:
    for seed in (0, 1):
        for r in rows("test", 50, seed=seed):
            words = r["prompt"].rpartition(": ")[2].rstrip("?").split(", ")
            assert split_of(words) == "test" and words[-1] == r["answer"]


def test_the_run_file_trains_validates_and_tests_on_disjoint_splits() -> None:
    tasks = load_settings(StackSettings, CONFIG).task_set()
    loaded = tasks.load(eval_size=200)["function"]
    train = {loaded.rows.row(i).prompt for i in loaded.train}
    validation = {row.prompt for _, row in loaded.validation}
    test = {row.prompt for _, row in loaded.test}
    assert len(train) > 10_000 and len(validation) >= 100 and len(test) >= 200
    assert not train & validation and not train & test and not validation & test
    spec = loaded.spec.eval
    assert spec.source is not None and spec.test_source is not None
    assert spec.source.kwargs["split"] == "val"  # type: ignore[union-attr]
    assert spec.test_source.kwargs["split"] == "test"  # type: ignore[union-attr]


def test_a_bare_word_scores_one_a_sentence_less_the_longer_it_is() -> None:
    spec = load_settings(StackSettings, CONFIG).task_set().specs["function"]
    parts = reward_payload(spec)

    def reward(text: str) -> float:
        return float(score(parts, text, "fish", {"row": 0, "response_tokens": 4})["reward"])

    assert reward("fish") == reward("fish.") == 1.0
    assert reward("dog") == reward("fish, dog") == 0.0
    long, short = 'The last word in this list is "fish."', "The answer is fish."
    assert 0.0 < reward(long) < reward(short) < 0.5
    assert brevity_credit("fish", "fish") == 0.0  # exact_match pays the bare word, not this part
    assert spec.correct_part == "exact_match"

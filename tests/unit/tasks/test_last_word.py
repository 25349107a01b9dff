"""The real-model demo's task: held-out lists never occur in training; the reward's shape."""

from __future__ import annotations

from services.runtime.settings import load_settings
from services.stack.demo_real import CONFIG
from services.stack.settings import StackSettings
from services.tasks.last_word import brevity_credit, names_the_word, rows, split_of
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


def test_every_answer_outscores_every_reply_that_is_not_one() -> None:
    """One part, right or wrong: no shaped credit, so nothing short of the answer can be a
    plateau the policy settles on (the earlier brevity credit paid "The last word: X")."""
    spec = load_settings(StackSettings, CONFIG).task_set().specs["function"]
    parts = reward_payload(spec)

    def reward(text: str) -> float:
        return float(score(parts, text, "fish", {"row": 0, "response_tokens": 4})["reward"])

    answers = ["fish", "Fish.", 'The last word in this list is "fish."', "The answer is: fish"]
    not_answers = [
        "dog",  # another of the list's words
        "chair, ladder, fish",  # the list echoed: it names the answer and others
        "fish or dog",  # hedged between two
        "The last word in this list is fishing.",  # not the word
        "",
        "The last word: X",  # the old plateau's shape without the word
    ]
    assert min(map(reward, answers)) == 1.0
    assert max(map(reward, not_answers)) == 0.0
    assert spec.correct_part == "named"


def test_names_the_word_reads_only_the_task_s_nouns() -> None:
    # Words outside the task's nouns (made-up ones the base model writes) do not count
    # against a reply; a second of its nouns does.
    assert names_the_word('It is "gullet", no: fish', "fish") == 1.0
    assert names_the_word("fish, then owl", "fish") == 0.0
    assert names_the_word("fish", None) == 0.0


def test_the_demo_lists_are_long_enough_to_start_low() -> None:
    # 7 to 12 nouns: the base model names the wrong word ~3 times in 4 (0.26 greedy on
    # 200 test lists; 3 to 8 nouns gave 0.385: bench/results_demo_real.md, 7).
    tasks = load_settings(StackSettings, CONFIG).task_set()
    for r in tasks.load(eval_size=50)["function"].test[:50]:
        n = len(r[1].prompt.rpartition(": ")[2].split(", "))
        assert 7 <= n <= 12


def test_brevity_credit_pays_a_shorter_right_sentence_more() -> None:
    # The earlier demo's shaped part, still the LoRA and distillation examples' reward.
    long, short = 'The last word in this list is "fish."', "The answer is fish."
    assert 0.0 < brevity_credit(long, "fish") < brevity_credit(short, "fish") < 0.5
    assert brevity_credit("fish", "fish") == 0.0  # exact_match pays the bare word
    assert brevity_credit("The answer is dog.", "fish") == 0.0

"""Sources, the held-out split, the training order, prompt formatting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.runtime.errors import ConfigError
from services.tasks.prompts import encode, format_row, readable, sft_messages
from services.tasks.sources import Row, load_rows
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet, TrainOrder, load_task


def spec(**kw: Any) -> TaskSpec:
    return TaskSpec.model_validate(kw)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def gsm_rows(n: int) -> list[dict[str, str]]:
    return [
        {"question": f"{i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(n)
    ]


def test_jsonl_fields_marker_messages_and_bad_rows(tmp_path: Path) -> None:
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            *gsm_rows(3),
            {"messages": [{"role": "user", "content": "hi"}], "answer": 7},
            "not json",  # one bad row: skipped, never the run
        ],
    )
    s = spec(
        source={
            "type": "jsonl",
            "path": str(data),
            "prompt_field": "question",
            "answer_marker": "####",
        },
        reward="gsm8k",
    )
    rows = load_rows(s.source)
    assert len(rows) == 4
    assert rows.row(1) == Row(prompt="1 + 1?", answer="2", solution="1 + 1 = 2\n#### 2")
    assert rows.row(3).messages == ({"role": "user", "content": "hi"},)
    assert rows.row(3).answer == "7"


def test_wrong_field_names_fail_naming_the_key(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", gsm_rows(5))
    s = spec(source={"type": "jsonl", "path": str(data)}, reward="math")
    with pytest.raises(
        ConfigError,
        match=r"\[task\] source: 5 of 5 records.*fields seen: "
        r"answer, question.*prompt_field",
    ):
        load_rows(s.source, "[task] source")
    with pytest.raises(ConfigError, match=r"source.path: file not found"):
        load_rows(
            spec(source={"type": "jsonl", "path": str(tmp_path / "no")}, reward="math").source
        )


def test_function_source_and_its_errors(tmp_path: Path) -> None:
    s = spec(
        source={
            "type": "function",
            "fn": "tests.unit.tasks.fixtures:rows",
            "kwargs": {"n": 4},
            "prompt_field": "q",
        },
        reward="exact_match",
    )
    rows = load_rows(s.source)
    assert len(rows) == 4 and rows.row(2) == Row(prompt="2*2", answer="4", solution="4")
    bad = spec(
        source={"type": "function", "fn": "tests.unit.tasks.fixtures:nope"}, reward="exact_match"
    )
    with pytest.raises(ConfigError, match="cannot import"):
        load_rows(bad.source)


def test_hf_dataset_directory_and_parquet(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_list(gsm_rows(6))
    d.save_to_disk(str(tmp_path / "ds"))
    d.to_parquet(str(tmp_path / "d.parquet"))
    for path in (tmp_path / "ds", tmp_path / "d.parquet"):
        s = spec(
            source={
                "type": "hf",
                "path": str(path),
                "prompt_field": "question",
                "answer_marker": "####",
            },
            reward="gsm8k",
        )
        rows = load_rows(s.source)
        assert len(rows) == 6 and rows.row(5).answer == "6" and rows.row(5).prompt == "5 + 1?"


def test_reasoning_gym_rows_are_its_generator() -> None:
    rg = pytest.importorskip("reasoning_gym")
    s = spec(
        source={
            "type": "reasoning_gym",
            "dataset": "basic_arithmetic",
            "size": 20,
            "seed": 3,
            "config": {"min_terms": 2, "max_terms": 2},
        }
    )
    rows = load_rows(s.source)
    ref = rg.create_dataset("basic_arithmetic", size=20, seed=3, min_terms=2, max_terms=2)
    assert len(rows) == 20 and rows.row(7).prompt == ref[7]["question"]
    assert rows.row(7).answer == str(ref[7]["answer"])


def test_holdout_is_seeded_disjoint_and_capped(tmp_path: Path) -> None:
    s = spec(source={"type": "arithmetic", "size": 1000}, eval={"holdout": 0.2, "size": 50})
    a, b = load_task("t", s, "[task]"), load_task("t", s, "[task]")
    val, test = [i for i, _ in a.validation], [i for i, _ in a.test]
    assert val == [i for i, _ in b.validation] and test == [i for i, _ in b.test]
    assert len(val) == len(test) == 50 and not set(val) & set(test)
    assert not (set(val) | set(test)) & set(a.train) and 700 < len(a.train) < 900
    other = spec(source={"type": "arithmetic", "size": 1000}, eval={"holdout": 0.2, "seed": 1})
    assert [i for i, _ in load_task("t", other, "[task]").validation][:50] != val
    sep = spec(
        source={"type": "arithmetic"},
        eval={"source": {"type": "arithmetic", "seed": 9}, "test_source": {"type": "arithmetic"},
              "size": 5},
    )  # fmt: skip
    t = load_task("t", sep, "[task]")
    vsrc, tsrc = sep.eval.source, sep.eval.test_source
    assert vsrc is not None and tsrc is not None
    assert len(t.train) == 100_000 and [r.prompt for _, r in t.validation] == [
        load_rows(vsrc).row(i).prompt for i in range(5)
    ]
    assert [r.prompt for _, r in t.test] == [load_rows(tsrc).row(i).prompt for i in range(5)]


def test_a_holdout_prompt_is_held_out_wherever_the_file_repeats_it(tmp_path: Path) -> None:
    """JSONL files repeat rows: a held-out prompt must not train through its copies, and
    validation and test share no prompt (each held-out prompt is evaluated once)."""
    rows = gsm_rows(300)
    data = write_jsonl(tmp_path / "d.jsonl", rows + rows[::3] + rows[::7])  # 443 rows, copies
    s = spec(
        source={"type": "jsonl", "path": str(data), "prompt_field": "question"},
        reward="gsm8k",
        eval={"holdout": 0.3, "size": 1000},
    )
    t = load_task("t", s, "[task]")
    train = {t.rows.row(i).prompt for i in t.train}
    val = [r.prompt for _, r in t.validation]
    test = [r.prompt for _, r in t.test]
    assert len(set(val)) == len(val) and len(set(test)) == len(test)  # once each
    assert not set(val) & set(test)
    assert not (set(val) | set(test)) & train
    assert len(train) + len(val) + len(test) == 300  # every distinct prompt in one split
    assert 30 < len(val) < 60 and 30 < len(test) < 60  # 0.3, half of it test
    assert t.source_of("validation") == t.source_of("test") == s.source


def test_separate_eval_files_are_dropped_from_training(tmp_path: Path) -> None:
    """A dev or test file that shares prompts with the training file: those prompts
    never train, and a prompt in both dev and test is evaluated as validation only."""
    rows = gsm_rows(100)
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dev = write_jsonl(tmp_path / "dev.jsonl", rows[:10] + rows[:10] + gsm_rows(130)[100:110])
    test = write_jsonl(tmp_path / "test.jsonl", rows[5:20])
    f = {"type": "jsonl", "prompt_field": "question"}
    s = spec(
        source={**f, "path": str(train)},
        reward="gsm8k",
        eval={"source": {**f, "path": str(dev)}, "test_source": {**f, "path": str(test)}},
    )
    t = load_task("t", s, "[task]")
    trained = {t.rows.row(i).prompt for i in t.train}
    val = [r.prompt for _, r in t.validation]
    tst = [r.prompt for _, r in t.test]
    assert len(val) == 20 and len(set(val)) == 20  # the dev file's repeats evaluate once
    assert tst == [r["question"] for r in rows[10:20]]  # 5..9 are validation prompts
    assert trained == {r["question"] for r in rows[20:]}


def test_a_mixture_task_never_trains_on_another_tasks_held_out_prompts(tmp_path: Path) -> None:
    rows = gsm_rows(200)
    a = write_jsonl(tmp_path / "a.jsonl", rows)  # trains on every prompt of b's file
    b = write_jsonl(tmp_path / "b.jsonl", rows[:100])
    f = {"type": "jsonl", "prompt_field": "question"}
    ts = TaskSet(
        {
            "a": spec(source={**f, "path": str(a)}, reward="gsm8k"),
            "b": spec(source={**f, "path": str(b)}, reward="gsm8k", eval={"holdout": 0.3}),
        },
        {"a": "[tasks.a]", "b": "[tasks.b]"},
    )
    loaded = ts.load()
    held_b = {r.prompt for _, r in loaded["b"].validation + loaded["b"].test}
    trained_a = {loaded["a"].rows.row(i).prompt for i in loaded["a"].train}
    assert held_b and not held_b & trained_a
    assert len(trained_a) == 200 - len(loaded["b"].held_keys)


def test_arithmetic_splits_partition_the_problem_space() -> None:
    """Every problem is in one split by a hash of the problem (a+b and b+a together), and a
    source of a split draws only its problems, whatever the seed."""
    from services.tasks.arithmetic import SPLITS, problem, split_of

    for digits, op in ((1, "+"), (2, "+"), (3, "*")):
        drawn = {sp: {problem(seed, i, digits, op, sp).prompt for seed in (0, 7, 1000003)
                      for i in range(300)} for sp in SPLITS}  # fmt: skip
        for sp, prompts in drawn.items():
            for p in prompts:
                a, b = (int(x) for x in p.rstrip("=").split(op))
                assert split_of(a, b, op) == split_of(b, a, op) == sp
        assert not drawn["train"] & drawn["validation"]
        assert not drawn["train"] & drawn["test"] and not drawn["validation"] & drawn["test"]


def test_mixture_order_follows_weights_and_visits_every_row() -> None:
    ts = TaskSet(
        {
            "a": spec(source={"type": "arithmetic", "size": 10}, weight=3),
            "b": spec(source={"type": "arithmetic", "size": 40, "digits": 3}, weight=1),
        },
        {"a": "[tasks.a]", "b": "[tasks.b]"},
    )
    order = TrainOrder.build(ts.load())
    assert order.counts == [38, 12] and len(order) == 50
    first = [order.item(0, i) for i in range(len(order))]
    assert sum(n == "a" for n, _ in first) == 38
    rows_b = {r for e in range(4) for n, r in (order.item(e, i) for i in range(50)) if n == "b"}
    assert rows_b == set(range(40))  # fewer slots than rows: later epochs go on


def test_format_and_encode_prompts() -> None:
    s = spec(source={"type": "arithmetic"}, prompt_template="Q: {prompt}\nA:")
    assert format_row(s, Row(prompt="1+1=")) == ("Q: 1+1=\nA:", None)
    sys_s = spec(source={"type": "arithmetic"}, system_prompt="Be brief.")
    _, msgs = format_row(sys_s, Row(prompt="hi"))
    assert msgs == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"})
    assert sft_messages(sys_s, Row(prompt="hi", answer="2", solution="1+1=2"))[-1] == {
        "role": "assistant",
        "content": "1+1=2",
    }

    class Tok:
        chat_template = "x"

        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

        def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> list[int]:
            return [len(messages), *self(messages[-1]["content"], False)["input_ids"]]

    assert encode(Tok(), "ab", None, chat_template=False) == [97, 98]
    assert encode(Tok(), "ab", None, chat_template=True) == [1, 97, 98]
    assert encode(Tok(), None, msgs, chat_template=False) == [2, 104, 105]


def test_flywheel_eval_shows_a_chat_prompt_as_its_turns_not_a_tuple_of_dicts() -> None:
    from services.stack.inspect import example_line

    s = spec(source={"type": "arithmetic"}, system_prompt="Reply with only the number.")
    text = readable(*format_row(s, Row(prompt="What is 3 + 4?")))
    assert text == "system: Reply with only the number.\nuser: What is 3 + 4?"
    line = example_line(text, "The answer is 7.", "7")
    assert line == "  user: What is 3 + 4?  ->  'The answer is 7.'  (answer 7)"
    assert example_line(readable("12+34=", None), "46", "46") == "  12+34=  ->  '46'  (answer 46)"

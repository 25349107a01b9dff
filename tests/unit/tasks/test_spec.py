"""The task spec: shorthands, defaults, and errors that name the run file's key."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.buffer.settings import BufferSettings
from services.rollout.settings import RolloutSettings
from services.runtime.errors import ConfigError
from services.runtime.settings import load_settings
from services.sync.settings import SyncSettings
from services.tasks.settings import TaskServiceSettings


def settings(tmp_path: Path, body: str, cls: type = TaskServiceSettings):
    p = tmp_path / "run.toml"
    p.write_text(body)
    return load_settings(cls, p)


def error(tmp_path: Path, body: str, cls: type = TaskServiceSettings) -> str:
    with pytest.raises(ConfigError) as e:
        settings(tmp_path, body, cls)
    return str(e.value)


def test_shorthands_and_defaults(tmp_path: Path) -> None:
    s = settings(
        tmp_path, '[task]\nsource = { type = "jsonl", path = "d.jsonl" }\nreward = "math"\n'
    )
    assert s.task is not None and [p.fn for p in s.task.reward] == ["math"]
    assert s.task_set().names == ["jsonl"] and s.task_set().keys["jsonl"] == "[task]"
    # arithmetic and reasoning-gym bring their own reward
    a = settings(tmp_path, '[task]\nsource = { type = "arithmetic" }\n').task
    assert a is not None and a.reward[0].fn == "exact_match" and a.correct_part == "exact_match"
    rg = settings(tmp_path, '[task]\nsource = { type = "reasoning_gym", dataset = "x" }\n')
    assert rg.task_set().names == ["reasoning_gym:x"]
    # a custom function by path, and a weighted sum of parts with names
    c = settings(
        tmp_path,
        '[task]\nsource = { type = "arithmetic" }\n'
        '[[task.reward]]\nfn = "gsm8k"\n'
        '[[task.reward]]\nfn = "pkg.mod:fn"\nweight = 0.5\nkwargs = { a = 1 }\n'
        '[[task.reward]]\nfn = "format"\nname = "fmt"\nweight = 0.1\n',
    ).task
    assert c is not None
    assert [(p.part_name, p.weight) for p in c.reward] == [
        ("gsm8k", 1.0),
        ("fn", 0.5),
        ("fmt", 0.1),
    ]


def test_mixture_by_name(tmp_path: Path) -> None:
    s = settings(
        tmp_path,
        '[tasks.add]\nsource = { type = "arithmetic" }\nweight = 3\n'
        '[tasks.big]\nsource = { type = "arithmetic", digits = 3 }\nweight = 1\n',
    )
    ts = s.task_set()
    assert ts.names == ["add", "big"] and ts.keys["big"] == "[tasks.big]"


ARITH = '[task]\nsource = { type = "arithmetic" }\n'
JSONL = '[task]\nsource = { type = "jsonl", path = "x" }\n'
BAD_SPECS = [
    (
        '[task]\nsource = { type = "jsonl" }\nreward = "math"\n',
        "[task] source.path: Field required",
    ),
    (JSONL, "[task] reward: required for source type 'jsonl'"),
    ('[task]\nsource = { type = "csv", path = "x" }\n', "[task] source"),
    (JSONL + 'reward = "mathh"\n', "[task] reward[0]: fn must be one of"),
    (
        ARITH + 'reward = [{ fn = "math", fallbak = true }]\n',
        "[task] reward[0].fallbak: unknown key; did you mean 'fallback'? (this table's keys: ",
    ),
    (  # the newcomer's: `name` for reasoning-gym's `dataset`
        '[task]\nsource = { type = "reasoning_gym", name = "basic_arithmetic" }\n',
        "[task] source.name: unknown key; did you mean 'dataset' (required, not given)? "
        "(this table's keys: type, dataset, config, size, seed)",
    ),
    (ARITH + 'reward = "reasoning_gym"\n', "'reasoning_gym' needs source type 'reasoning_gym'"),
    (ARITH + 'reward = [{ fn = "format", pattern = "(" }]\n', "reward[0].pattern: not a regular"),
    (
        ARITH + 'reward = [{ fn = "soft_overlong", max_tokens = 4, buffer_tokens = 8 }]\n',
        "buffer_tokens must be <= max_tokens",
    ),
    (ARITH + 'prompt_template = "{question}"\n', "[task] prompt_template: must use {prompt}"),
    (ARITH + 'reward = ["exact_match", "exact_match"]\n', "part names must differ"),
    (ARITH + '[task.eval]\nholdout = 0.1\nsource = { type = "arithmetic" }\n', "not both"),
    (ARITH + '[task.eval]\npart = "nope"\n', "eval.part: 'nope' is not a reward part"),
    (  # a held-out source that draws training problems is refused, naming the key
        ARITH + '[task.eval]\nsource = { type = "arithmetic", split = "train" }\n',
        "eval.source.split: 'train', but this source is the validation split",
    ),
    (
        ARITH + '[task.eval]\nsource = { type = "arithmetic" }\n'
        'test_source = { type = "arithmetic", split = "validation" }\n',
        "eval.test_source.split: 'validation', but this source is the test split",
    ),
    (ARITH + '[task.eval]\ntest_source = { type = "arithmetic" }\n', "needs eval.source"),
    (
        '[tasks.a]\nsource = { type = "jsonl", path = "x", prompt_fild = "q" }\nreward = "math"\n',
        "[tasks.a] source.prompt_fild: unknown key; did you mean 'prompt_field'?",
    ),
]


@pytest.mark.parametrize(("body", "expected"), BAD_SPECS)
def test_bad_spec_names_the_key(tmp_path: Path, body: str, expected: str) -> None:
    assert expected in error(tmp_path, body)


def test_services_that_need_a_task_refuse_to_start_without_one(tmp_path: Path) -> None:
    for cls in (BufferSettings, RolloutSettings):
        assert "[task] missing" in error(tmp_path, 'run = "r"\n', cls)
    assert settings(tmp_path, 'run = "r"\n', SyncSettings).task is None  # sync needs none
    both = '[task]\nsource = { type = "arithmetic" }\n[tasks.a]\nsource = { type = "arithmetic" }\n'
    assert "not both" in error(tmp_path, both, BufferSettings)


def test_the_pre_task_buffer_keys_say_where_they_went(tmp_path: Path) -> None:
    """The issue's reproduction, uncorrected: it fails at start-up naming the keys."""
    msg = error(
        tmp_path,
        '[buffer]\nsource = "jsonl"\ndataset = "data.jsonl"\nenv = "jsonl"\n',
        BufferSettings,
    )
    assert "[buffer] dataset, env, source" in msg and "[task]" in msg


def test_environment_overrides_reach_the_task(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLYWHEEL_BUFFER_TASK__SOURCE__DIGITS", "3")
    s = settings(tmp_path, '[task]\nsource = { type = "arithmetic" }\n', BufferSettings)
    assert s.task is not None and s.task.source.digits == 3  # type: ignore[union-attr]


def test_an_unknown_key_of_a_section_names_the_nearest_of_its_own_keys(tmp_path: Path) -> None:
    msg = error(tmp_path, ARITH + "[buffer]\nmax_new_tokenz = 16\n", BufferSettings)
    assert "[buffer] max_new_tokenz: unknown key; did you mean 'max_new_tokens'? " in msg
    keys = msg.split("(this table's keys: ")[1]
    assert "groups_per_step" in keys and "nats" not in keys  # its own keys, not the shared
    far = error(tmp_path, ARITH + "[buffer]\nzzz = 1\n", BufferSettings)
    assert "[buffer] zzz: unknown key; (this table's keys: seed, " in far  # no guess: none near

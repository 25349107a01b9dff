"""The pure parts of `flywheel replay`: task ids, --set, --reward, version comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.replay.compare import compare_version
from services.replay.rescore import judge_urls, reward_value
from services.replay.retrain import set_env, verdict
from services.replay.samples import parse_task_id
from services.replay.source import recorded_run
from services.runtime.errors import ConfigError
from tests.harness.runfile import run_file


def test_task_ids_give_back_the_buffers_epoch_and_position() -> None:
    assert parse_task_id("demo:e3:i17") == (3, 17)
    assert parse_task_id("run-with-dashes:e0:i0") == (0, 0)
    assert parse_task_id("demo:3:17") is None
    assert parse_task_id("something-else") is None


def test_set_becomes_a_trainer_environment_override() -> None:
    assert set_env(["optim.lr=1e-5", "loss.kl_coef=0.01"]) == {
        "FLYWHEEL_TRAINER_OPTIM__LR": "1e-5",
        "FLYWHEEL_TRAINER_LOSS__KL_COEF": "0.01",
    }
    with pytest.raises(ConfigError, match="key=value"):
        set_env(["optim.lr"])


def test_reward_takes_a_toml_value_or_a_bare_name() -> None:
    assert reward_value("math") == "math"
    assert reward_value('"exact_match"') == "exact_match"
    assert reward_value('{fn = "format", pattern = "x"}') == {"fn": "format", "pattern": "x"}


def write(d: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Path:
    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"), metadata=meta)
    return d


def test_versions_compare_by_bytes_then_by_tensors(tmp_path: Path) -> None:
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    run = write(tmp_path / "run", a)
    same = compare_version(1, run, write(tmp_path / "same", a))
    assert same.bytes_equal and same.tensors_equal and "identical" in same.line()
    meta = compare_version(1, run, write(tmp_path / "meta", a, {"format": "pt", "x": "1"}))
    assert not meta.bytes_equal and meta.tensors_equal and "metadata" in meta.line()
    moved = {**a, "w": a["w"] + 0.5}
    diff = compare_version(1, run, write(tmp_path / "moved", moved))
    assert not diff.tensors_equal and diff.differing == ["w"] and diff.max_abs_diff == 0.5
    assert "differs: 1 tensors" in diff.line()
    gone = compare_version(1, run, tmp_path / "nothing")
    assert gone.missing is not None and "not compared" in gone.line()
    assert gone.missing_in == "replay" and not gone.written
    pruned = compare_version(1, tmp_path / "pruned", run)
    assert pruned.missing_in == "run" and pruned.written


def test_a_replay_passes_only_on_what_it_compared(tmp_path: Path) -> None:
    """Each way a replay can compare nothing, or less than the run has, fails with one line."""
    a = {"w": torch.ones(2)}
    run, none = tmp_path / "run", tmp_path / "none"
    v = {n: write(run / f"v{n}", a) for n in (1, 2)}
    same = {n: write(tmp_path / "same" / f"v{n}", a) for n in (1, 2)}
    other = write(tmp_path / "other", {"w": torch.zeros(2)})
    equal = [compare_version(n, v[n], same[n]) for n in (1, 2)]
    assert verdict(equal, []) == (0, "flywheel replay: 2 versions equal to the run's, bit for bit")
    # the replay's trainer wrote nothing: a failure, with or without --set
    nothing = [compare_version(n, v[n], none / str(n)) for n in (1, 2)]
    for sets in ([], ["optim.lr=1"]):
        code, line = verdict(nothing, sets)
        assert code == 1 and "the replay wrote no version (v1..v2)" in line, line
        assert "\n" not in line
    # one version the run has and the replay did not write: never "not compared" and passed
    half = [equal[0], compare_version(2, v[2], none / "2")]
    code, line = verdict(half, [])
    assert code == 1 and "no weights for versions [2], which the run has" in line, line
    # the run kept none of them (sync's keep_last): nothing compared is a failure, not a pass
    pruned = [compare_version(n, tmp_path / "gone" / str(n), same[n]) for n in (1, 2)]
    code, line = verdict(pruned, [])
    assert code == 1 and "no version of the run left to compare" in line, line
    assert verdict(pruned, ["optim.lr=1"])[0] == 0  # an ablation wrote its own: done
    # a version the run pruned beside one compared equal: the compared one carries it
    assert verdict([pruned[0], equal[1]], [])[0] == 0
    code, line = verdict([equal[0], compare_version(2, v[2], other)], [])
    assert code == 1 and "versions [2] differ" in line, line


JUDGED = """
[task]
source = { type = "arithmetic", digits = 1 }
[[task.reward]]
type = "judge"
name = "digits"
rubric = "Grade: {completion}"
"""


def test_rescore_asks_a_judge_for_judge_parts_or_refuses_naming_them(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(run_file("judged", stack={"run_dir": str(tmp_path)}) + JUDGED)
    rec = recorded_run(config)
    with pytest.raises(ConfigError, match=r"\[task\] reward 'digits': scored by an LLM judge"):
        judge_urls(rec, [])
    assert judge_urls(rec, ["http://127.0.0.1:9"]) == ("http://127.0.0.1:9",)
    config.write_text(config.read_text() + '[judge]\nurls = ["http://127.0.0.1:8"]\n')
    assert judge_urls(recorded_run(config), []) == ("http://127.0.0.1:8",)
    # a run without judge parts needs none, and refuses one given for nothing
    plain = tmp_path / "plain.toml"
    plain.write_text(run_file("plain", stack={"run_dir": str(tmp_path)},
                              task={"source": {"type": "arithmetic", "digits": 1}}))  # fmt: skip
    assert judge_urls(recorded_run(plain), []) == ()
    with pytest.raises(ConfigError, match="no reward part of the run file is a judge's"):
        judge_urls(recorded_run(plain), ["http://127.0.0.1:9"])

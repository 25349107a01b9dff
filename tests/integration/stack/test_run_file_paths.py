"""One reading of a run file for every command (services/runtime/settings.py, "Paths").

A run file written the way the README and the shipped SmolLM2 examples write
them: `[stack] model = "~/.cache/flywheel/models/..."`, the data given relative
to the directory the user runs in, here a project directory that is not the
repository. Each command's reading of it, in that directory: `up` (its
pre-flight and model), `eval`, `replay`, `demo` (the run file it writes for
its RL stage), the benches (the side-by-side's model and threads, TRL's task
and hyper-parameters): `~` is the home directory, the data is found, the model
directory is the same one. Before, `flywheel replay export` took
`~/.cache/...` for a hub id and ended in a huggingface_hub traceback.

And a bad model path, or data not where the run file says (run from another
directory), is one line naming the key from every command, run as a user
runs it (`python -m services ...`), never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

MODEL = "~/.cache/flywheel/models/Tiny-Instruct"

RUN_FILE = """run = "paths"

[stack]
run_dir = "runs/paths"
model = "{model}"
engines = 1

[task]
source = {{ type = "jsonl", path = "data/train.jsonl", prompt_field = "q", answer_field = "a" }}
reward = "exact_match"

[task.eval]
source = {{ type = "jsonl", path = "data/val.jsonl", prompt_field = "q", answer_field = "a" }}
"""


def write_project(root: Path, model: str = MODEL) -> Path:
    """A user's project directory: data/, run.toml; its HOME holds the model."""
    project = root / "my-task"
    (project / "data").mkdir(parents=True)
    for split, n in (("train", 6), ("val", 3)):
        rows = [json.dumps({"q": f"{split} {i}?", "a": str(i)}) for i in range(n)]
        (project / "data" / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    (project / "run.toml").write_text(RUN_FILE.format(model=model))
    return project


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    model = Path(MODEL.replace("~", str(home)))
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")  # a model directory, as resolve_model sees one
    monkeypatch.setenv("HOME", str(home))
    project = write_project(tmp_path)
    monkeypatch.chdir(project)
    assert Path.cwd() != REPO
    return project


def home_model() -> Path:
    return Path(os.environ["HOME"]) / ".cache/flywheel/models/Tiny-Instruct"


def test_up_reads_the_home_model_and_the_relative_data(project: Path) -> None:
    from services.runtime.settings import load_settings
    from services.stack.cli import preflight, with_model
    from services.stack.settings import StackSettings

    s = load_settings(StackSettings, "run.toml")
    assert s.model == home_model() and s.run_dir == Path("runs/paths")
    assert preflight(s, "run.toml") == 0  # every service's settings, the data, the model
    assert with_model(s).model == home_model()
    loaded = s.task_set().load()
    assert len(next(iter(loaded.values())).rows) == 6


def test_eval_evaluates_the_home_model(project: Path) -> None:
    from services.stack.inspect import eval_target

    tasks, model = eval_target("run.toml", None)
    assert model == home_model()
    tasks.check(data=True)


def test_replay_reads_the_run_where_up_kept_it(project: Path) -> None:
    from services.replay.source import recorded_run

    rec = recorded_run(Path("run.toml"))
    assert rec.model_dir() == home_model()  # was '~/.cache/...' taken for a hub id
    assert rec.run_dir == project / "runs" / "paths"
    rec.settings.task_set().check(data=True)


def test_demo_s_run_file_reads_the_same_data(project: Path) -> None:
    from services.runtime.settings import load_settings
    from services.stack.demo import run_file
    from services.stack.settings import StackSettings

    run_dir = project / "runs" / "demo-paths"
    run_dir.mkdir(parents=True)
    rf = run_file(Path("run.toml"), run_dir, home_model(), None)
    s = load_settings(StackSettings, rf)
    assert s.model == home_model()
    s.task_set().check(data=True)  # relative to where the demo runs, as up reads them


def test_the_benches_read_it_as_up_does(project: Path) -> None:
    from bench.learning_side_by_side import model_of, run_threads
    from bench.trl_grpo import demo_hparams, load_tasks

    assert model_of(Path("run.toml"), None) == home_model()
    assert run_threads(Path("run.toml")) == 2  # one engine thread, one trainer thread
    assert demo_hparams(Path("run.toml"))["samples_per_prompt"] == 8
    load_tasks(Path("run.toml")).check(data=True)


def flywheel(cwd: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(home / "hf-cache")}  # fmt: skip
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "services", "up", "-c", "run.toml"],
        ["-m", "services", "eval", "-c", "run.toml"],
        ["-m", "services", "replay", "export", "-c", "run.toml", "--parquet", "x.parquet"],
        [str(REPO / "bench" / "learning_side_by_side.py"), "-c", "run.toml"],
    ],
    ids=["up", "eval", "replay-export", "side-by-side"],
)
def test_a_bad_model_path_is_one_line_naming_the_key(tmp_path: Path, command: list[str]) -> None:
    project = write_project(tmp_path, model="~/.cache/flywheel/models/Not-Imported")
    (tmp_path / "home" / "hf-cache").mkdir(parents=True)
    r = flywheel(project, tmp_path / "home", *command)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    where = tmp_path / "home" / ".cache/flywheel/models/Not-Imported"  # ~ read as home
    assert f"[stack] model = '{where}'" in lines[0]
    assert "no such model directory" in lines[0]


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "services", "up", "-c", "run.toml"],
        ["-m", "services", "eval", "-c", "run.toml"],
        ["-m", "services", "demo", "-c", "run.toml"],
        [str(REPO / "bench" / "learning_side_by_side.py"), "-c", "run.toml"],
    ],
    ids=["up", "eval", "demo", "side-by-side"],
)
def test_data_not_where_the_run_file_says_is_one_line_naming_the_key(
    tmp_path: Path, command: list[str]
) -> None:
    """Run from another directory than the data's: the same one line from each command."""
    project = write_project(tmp_path)
    model = tmp_path / "home" / ".cache/flywheel/models/Tiny-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = [str(project / "run.toml") if c == "run.toml" else c for c in command]
    r = flywheel(elsewhere, tmp_path / "home", *command)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert "source.path: not found: data/train.jsonl" in lines[0], lines[0]
    assert f"(from {elsewhere})" in lines[0], lines[0]  # where relative paths are from


def test_side_by_side_says_how_to_install_trl(project: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("trl") is not None:
        pytest.skip("TRL is installed here: nothing to say")
    r = flywheel(project, Path(os.environ["HOME"]),
                 str(REPO / "bench" / "learning_side_by_side.py"), "-c", "run.toml",
                 "--out-dir", str(project / "sbs"))  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"side_by_side: TRL is not installed (the TRL side needs it): pip install -e "
        f"'.[bench]' in {REPO}"
    ]
    assert not (project / "sbs").exists()  # nothing ran

"""`flywheel check` on real parts: a tiny model (services/models/tiny_model.py), a JSONL,
the verifier sandbox's pool, as a user runs it (`python -m services check -c run.toml`).

The task whose answers the model never gives ("zebracorn-7": a random character-level
model does not spell it) warns, exit 3; one it sometimes solves (a reward that pays
about half of any model's replies) does not, exit 0; a bad run file is exit 2. And
`flywheel up` prints the check's verdict line before it starts anything, unless told
not to (`--no-check`, `[stack] check = false`).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from services.models.tiny_model import write_tiny_model
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.up import flywheel, start, stop

PAYS_HALF = "tests.integration.stack.check_fixtures:even_sum"


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model and a JSONL whose answers it never produces."""
    d = tmp_path_factory.mktemp("check")
    write_tiny_model(d / "model")
    rows = ({"q": f"Name animal number {i}.", "a": f"zebracorn-{i}"} for i in range(40))
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def config(d: Path, name: str, reward: str, *, services: tuple[str, ...] = (), **task: str) -> Path:
    """The run file; `services`: `[stack] services` (none given: up's default, all five)."""
    source = {"type": "jsonl", "path": str(d / "train.jsonl"), "prompt_field": "q",
              "answer_field": "a"}  # fmt: skip
    only = {"services": list(services)} if services else {}
    text = run_file(
        name,
        stack={"run_dir": d / f"run-{name}", "model": d / "model", "engines": 1, **only},
        buffer={"max_new_tokens": 8},
    )
    text += "\n[task]\nsource = " + "{ " + ", ".join(f'{k} = "{v}"' for k, v in source.items())
    text += " }\n" + f'reward = "{reward}"\n' + "".join(f'{k} = "{v}"\n' for k, v in task.items())
    path = d / f"{name}.toml"
    path.write_text(text)
    return path


def test_help() -> None:
    r = flywheel("check", "--help")
    assert r.returncode == 0 and "-k K" in r.stdout and "samples_per_prompt" in r.stdout


def test_warns_on_a_task_whose_answers_the_model_never_gives(task: Path) -> None:
    r = flywheel("check", "-c", str(config(task, "never", "exact_match")), "-n", "12",
                 timeout=240)  # fmt: skip
    assert r.returncode == 3, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert "12 training prompts x 8 replies (temperature 0.7, max_new_tokens 8" in lines[0]
    assert "pass@1 0.000  pass@8 0.000  flat groups 1.000" in lines[1]
    assert "replies naming the answer 0.000" in lines[1]
    assert sum("(answer zebracorn-" in x for x in lines) == 3  # the sample replies
    assert lines[-1].startswith("flywheel check: WARNING: no reply of 96 was correct"), lines[-1]
    assert "prompt_template" in lines[-1] and "flywheel sft" in lines[-1]


def test_does_not_warn_on_a_task_the_model_sometimes_solves(task: Path) -> None:
    # the reward is the tests' own code: the sandbox where this host has one, else plain
    # processes (what is tested here is the check, not the sandbox's walls)
    cfg = config(task, "some", PAYS_HALF, sandbox="insecure-allow")
    r = flywheel("check", "-c", str(cfg), "-n", "12", "-k", "4", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "12 training prompts x 4 replies" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("flywheel check: ok: ") and "RL has something to learn from" in last


def test_a_bad_run_file_is_exit_2_in_one_line(task: Path) -> None:
    cfg = config(task, "bad", "exact_match")
    cfg.write_text(cfg.read_text().replace("train.jsonl", "missing.jsonl"))
    r = flywheel("check", "-c", str(cfg), timeout=120)
    assert r.returncode == 2 and "missing.jsonl" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    r = flywheel("check", "-c", str(config(task, "never", "exact_match")), "-k", "1")
    assert r.returncode == 2 and "-k >= 2" in r.stderr, r.stderr


# What the up tests below start: NATS and the buffer. What they read is whether the check's
# line comes before NATS, the first thing up starts; nothing after it, so they start no
# engine, worker, sync or trainer (torch in four processes) that nothing would read.
UP_SERVICES = ("buffer",)


def up_until_nats(task: Path, cfg: Path, *args: str) -> str:
    """`flywheel up` until it has started NATS (after any check), then Ctrl-C; its console."""
    log = task / f"{cfg.stem}-up.log"
    proc = start(["up", "-c", str(cfg), *args], log)
    try:
        wait_for(lambda: "embedded nats-server" in log.read_text(), timeout_s=240,
                 what="flywheel up to start NATS after its check")  # fmt: skip
    finally:
        stop(proc, signal.SIGINT)
    return log.read_text()


def test_up_prints_the_verdict_before_it_starts_anything(task: Path) -> None:
    out = up_until_nats(task, config(task, "up", "exact_match", services=UP_SERVICES))
    check = next(x for x in out.splitlines() if x.startswith("flywheel up: check ("))
    assert "WARNING: no reply of 256 was correct" in check
    assert out.index(check) < out.index("embedded nats-server")


def test_up_skips_the_check_when_told(task: Path) -> None:
    flag = config(task, "flag", "exact_match", services=UP_SERVICES)
    assert "flywheel up: check" not in up_until_nats(task, flag, "--no-check")
    cfg = config(task, "key", "exact_match", services=UP_SERVICES)
    cfg.write_text(cfg.read_text().replace("[stack]\n", "[stack]\ncheck = false\n"))
    assert "check = false" in cfg.read_text()
    assert "flywheel up: check" not in up_until_nats(task, cfg)


def test_a_ctrl_c_while_up_starts_stops_what_started_at_once(task: Path) -> None:
    """Engines of a real model take minutes to load: a Ctrl-C meanwhile ends the run then,
    not once every service is ready (it did: services start in sessions of their own, so
    the terminal's Ctrl-C reaches `up` alone, which waited for them all)."""
    cfg = config(task, "interrupted", "exact_match")  # all five services
    run_dir = task / "run-interrupted"
    log = task / "interrupted-up.log"
    proc = start(["up", "-c", str(cfg), "--no-check"], log)
    try:
        wait_for(lambda: (run_dir / "pids.json").is_file(), timeout_s=240,
                 what="flywheel up to start its first service")  # fmt: skip
    finally:
        code = stop(proc, signal.SIGINT)
    out = log.read_text()
    assert code == 130, out[-3000:]
    assert "stopped while starting; stopping what has started" in out, out[-3000:]
    assert "all services ready" not in out
    for name, pid in json.loads((run_dir / "pids.json").read_text()).items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) still runs"

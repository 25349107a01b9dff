"""A bad run file stops every service at start: exit code 2, a message naming the field.

Each service's real entry point runs as a subprocess (as `flywheel up` and
Kubernetes start it) with one invalid value in its section; it must exit
before connecting anywhere (the NATS URL points at a closed port, so a
service that got past its settings would hang in connect retries instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

ROOT = REPO
DEAD_NATS = "nats://127.0.0.1:9"  # discard port: nothing listens

CASES = [
    # (entry point, run-file body, words the error must contain)
    (["-m", "services.buffer"], "[buffer]\ngroups_per_step = 0\n", ["[buffer]", "groups_per_step"]),
    (["-m", "services.buffer"], "[buffer]\ngroups_per_stepp = 4\n", ["groups_per_stepp"]),
    (["-m", "services.sync"], '[sync]\nupdate_mode = "yolo"\n', ["[sync]", "update_mode"]),
    (["-m", "services.rollout"], "[rollout]\nconcurrency = -3\n", ["[rollout]", "concurrency"]),
    (["-m", "services.trainer"], "[trainer]\npublish_every = 0\n", ["[trainer]", "publish_every"]),
    (["-m", "services.engine"], "[engine]\nport = 70000\n", ["[engine]", "port"]),
    (
        ["-m", "services.buffer"],
        '[nats]\nconnect_attempts = "many"\n',
        ["nats", "connect_attempts"],
    ),
    (["-m", "services.buffer"], 'run = "a.b"\n', ["run"]),  # not one subject token
    (["-m", "services.buffer"], "[buffer\n", ["not valid TOML"]),
    (["-m", "services.cli", "up"], "[stack]\nengines = -1\n", ["[stack]", "engines"]),
    # the JSONL reproduction, uncorrected: `flywheel up` stops before starting anything
    (["-m", "services.cli", "up"],
     '[buffer]\nsource = "jsonl"\ndataset = "d.jsonl"\nenv = "jsonl"\n',
     ["[buffer] dataset, env, source", "[task] missing"]),
    (["-m", "services.cli", "up"], '[task]\nsource = { type = "jsonl", path = "nope.jsonl" }\n'
     'reward = "math"\n', ["[task] source.path: not found"]),
    (["-m", "services.rollout"], '[task]\nsource = { type = "jsonl" }\n', ["[task] source.path"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "body", "words"), CASES, ids=[" ".join(c[0]) + f":{i}" for i, c in enumerate(CASES)]
)
def test_bad_value_exits_2_naming_the_field(
    tmp_path: Path, argv: list[str], body: str, words: list[str]
) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[nats]\nurl = "{DEAD_NATS}"\n' + body if "[nats]" not in body else body)
    proc = subprocess.run(
        [sys.executable, *argv, "-c", str(run_file)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    for w in words:
        assert w in proc.stderr, (w, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr


def test_non_utf8_run_file_is_a_config_error(tmp_path: Path) -> None:
    """Found by the run-file fuzzer: bytes that are not UTF-8 raised UnicodeDecodeError."""
    run_file = tmp_path / "run.toml"
    run_file.write_bytes(b'run = "x\xff"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "services.buffer", "-c", str(run_file)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2 and "cannot be read" in proc.stderr, proc.stderr[-2000:]

"""`flywheel up` without a model stops at once, in one line naming `[stack] model`.

Real subprocesses (`python -m services up -c run.toml`), as a newcomer who
forgot `flywheel init-model` runs it: a missing directory, and a hub id that
is not in the local Hugging Face cache (an empty one here; nothing is ever
downloaded). Before, the engines started and died with a transformers
traceback ("Repo id must be in the form 'repo_name'…"). A hub id that is in
the cache is read from it (`flywheel eval`, the same resolution).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO
from tests.unit.models.test_resolve import hub_cache_with


def run_file(tmp: Path, model: str) -> Path:
    p = tmp / "run.toml"
    p.write_text(f"""
run = "nomodel"

[stack]
run_dir = "{tmp / "run"}"
model = "{model}"
engines = 1

[task]
source = {{ type = "arithmetic", digits = 1 }}
""")
    return p


def flywheel(tmp: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(tmp / "hf-cache"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "services", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("runs/forgot-init-model/model", "no such model directory"),
        ("nobody/no-such-model", "not in the local Hugging Face cache"),
    ],
)
def test_up_without_a_model_stops_in_one_line_naming_it(tmp_path: Path, model: str,
                                                        says: str) -> None:  # fmt: skip
    (tmp_path / "hf-cache").mkdir()
    # The bound only tells "stops before starting anything" (a few seconds of imports and
    # settings) from engines starting and dying; nothing is timed more tightly than that.
    r = flywheel(tmp_path, "up", "-c", str(run_file(tmp_path, model)), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"flywheel up: [stack] model = '{model}'"), lines[0]
    assert "flywheel import-model" in lines[0] and "make smollm2" in lines[0]
    assert says in lines[0] and "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no service was started


def test_a_hub_id_in_the_local_cache_is_read_from_it(tiny_model: Path, tmp_path: Path) -> None:
    hub_cache_with(tmp_path / "hf-cache", "flywheel-tests/tiny", tiny_model)
    r = flywheel(tmp_path, "eval", "flywheel-tests/tiny", "-n", "4", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["total"] == 4 and "models--flywheel-tests--tiny/snapshots/" in doc["model"]

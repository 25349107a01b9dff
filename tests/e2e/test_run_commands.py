"""`flywheel up` as a user runs it: a systematic error stops the run, with its cause.

Real processes: `python -m services up -c run.toml` (embedded NATS, one CPU
engine with its worker, and the buffer: `[stack] services` leaves out the
trainer and sync, which play no part in how a failing reward stops a run).
The running run seen from outside (status, an added worker, Prometheus) is
tests/e2e/test_live_run.py.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.harness.up import QUIET_ENV, UpRun


def run_toml(tmp: Path, model: Path, reward: str, run: str) -> Path:
    p = tmp / "run.toml"
    p.write_text(f"""
run = "{run}"

[stack]
run_dir = "{tmp / "run"}"
model = "{model}"
engines = 1
engine_threads = 1
on_failure = "stop"
status_interval_s = 1
services = ["engine", "rollout", "buffer"]

[task]
source = {{ type = "arithmetic", digits = 1 }}
reward = "{reward}"

[buffer]
# No trainer runs, so no version beyond 0 is ever ready: admission lets
# (max_staleness + 1) * groups_per_step = 32 tasks out, which must exceed
# halt_after (16) for the systematic failure to show.
samples_per_prompt = 4
groups_per_step = 8
max_staleness = 3
max_new_tokens = 4
filter_zero_variance = false
dispatch_interval_s = 0.1

[rollout]
concurrency = 4
heartbeat_s = 0.3

[trainer.runtime]
cpu_threads = 1

[sync]
tick_s = 0.1
""")
    return p


@pytest.mark.slow
def test_every_task_failing_the_same_way_stops_the_run(tiny_model: Path, tmp_path: Path) -> None:
    config = run_toml(tmp_path, tiny_model, "tests.unit.tasks.fixtures:raises", "failfast")
    with UpRun(config, tmp_path / "run") as up:
        up.wait_ready(180)
        ready = time.monotonic()
        # ~10 s on a quiet machine; the bound only tells "stops" from "dead-letters
        # forever", with room for a loaded machine.
        code = up.wait_exit(120)
        stopped = time.monotonic()
    out = up.output()
    assert code != 0, out[-3000:]
    assert "buffer stopped the run" in out and "ValueError: reward bug" in out, out[-3000:]
    assert "16 tasks in a row failed the same way" in out
    assert stopped - ready < 120, f"{stopped - ready:.1f}s after ready"
    assert not (tmp_path / "run" / "run.json").exists()  # the record goes with the run


STEPS_RUN = """
run = "steps"

[stack]
run_dir = "{run_dir}"
model = "{model}"
engines = 1
engine_threads = 1
on_failure = "stop"
# The status line (what `--steps` was checked against) looks every 5 s; the tiny model's steps
# take well under a second, so a stop decided there would train several steps too many.
status_interval_s = 5

[task]
source = {{ type = "arithmetic", digits = 1 }}

[buffer]
samples_per_prompt = 4
groups_per_step = 2
max_new_tokens = 4
max_staleness = 2
filter_zero_variance = false  # a random model scores 0 everywhere: let batches form
dispatch_interval_s = 0.1

[rollout]
concurrency = 4
heartbeat_s = 0.3

[trainer.runtime]
cpu_threads = 1

[sync]
tick_s = 0.1
"""


# A service's INFO record as the console shows it: `[buffer] 2026-…Z buffer INFO logger: …`
SERVICE_INFO = re.compile(r"^\[[\w-]+\] \S+Z \S+ INFO ", re.M)


@pytest.mark.slow
@pytest.mark.parametrize(("where", "verbose"), [("--steps", False), ("run file", True)])
def test_up_steps_trains_exactly_that_many_steps(
    tiny_model: Path, tmp_path: Path, where: str, verbose: bool
) -> None:
    """`flywheel up --steps 3` trained 7: the stop was decided on the status line, seconds
    after the step, while the batches in flight went on training. Now the trainer stops
    itself after step 3 and its exit ends the run. `[trainer] max_steps = 3` in the run
    file is the same end (it was a trainer exit the supervisor restarted).

    The console: the services' INFO lines go to their log files only, unless `--verbose`."""
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    text = STEPS_RUN.format(run_dir=run_dir, model=tiny_model)
    args = ("--steps", "3") if where == "--steps" else ()
    args += ("--verbose",) if verbose else ()
    if where == "run file":
        text = text.replace("[trainer.runtime]", "[trainer]\nmax_steps = 3\n\n[trainer.runtime]")
    config.write_text(text)
    # A user's shell: nothing set that quiets transformers (flywheel itself must)
    env = {k: v for k, v in {**os.environ, **QUIET_ENV}.items() if "PROGRESS_BARS" not in k}
    with UpRun(config, run_dir, *args, env=env) as up:
        code = up.wait_exit(240)
    out = up.output()
    assert code == 0, out[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2, 3]
    published = sorted(p.name for p in (run_dir / "weights" / "steps").iterdir())
    assert published[-1] == "v000003", published
    assert "trainer finished (3 steps)" in out, out[-3000:]
    # transformers' bars (a line per redraw in every engine's and the trainer's output) are off
    assert "Loading weights" not in out and "Writing model shards" not in out
    assert " INFO " in up.service_log("trainer") and " INFO " in up.service_log("buffer")
    if verbose:
        assert SERVICE_INFO.search(out), out[-3000:]
    else:
        assert not SERVICE_INFO.search(out), SERVICE_INFO.findall(out)[:5]
        assert "(--verbose shows them here)" in out

"""The whole stack as subprocesses learns: `flywheel demo` end to end.

Real everything: embedded nats-server, two CPU engines with a rollout
worker each, buffer, trainer, sync; a tiny model warmed up by SFT on
addition where most labels write the carry out of the tens as 0, then
async GRPO. The same SFT model is then trained synchronously
(max_staleness = 0).

Each RL run stops once the trainer's evaluation on the validation split
reaches what the test asserts (`flywheel demo --target-accuracy`), not at
its step cap. The demo's before/after accuracy is measured on the test
split (`--eval-size 200` problems), which no stage trains on or chooses on
(services/tasks/arithmetic.py partitions the problem space): the stop is
taken on validation and the assertion reads test, as a reported figure
must be. The run ends a step or two after the evaluation that met the
target, so the demo hands over (and scores) the weights of the trainer's
best validation evaluation, not the never-evaluated last ones. The stop's
target is `MARGIN` above the assertion, for the gap between the two splits
and the two processes' thread counts (greedy ties can break differently).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The whole stack, twice, after an SFT warm start: ~7 minutes, so `make test-long`
# (which CI runs after make test), keeping make test under 10 minutes.
pytestmark = [pytest.mark.slow, pytest.mark.long]

RL_SECONDS = 300  # the budget: 0.9 within 5 minutes of RL
TARGET = 0.90  # test-split greedy accuracy the async run must reach
SYNC_GAIN = 0.10  # what the synchronous run must add to the SFT model's accuracy
MARGIN = 0.02  # the stop's target above the assertion (the module docstring)
EVAL_SIZE = "200"  # test problems the demo reports on (the trainer validates on 200 others)


def demo(run_dir: Path, *args: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "services", "demo", "--run-dir", str(run_dir), "--quiet", *args]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)  # `flywheel up` stops its services in order
        out, _ = p.communicate(timeout=60)
        raise AssertionError(f"demo did not finish in {timeout}s:\n{out[-4000:]}") from None
    assert p.returncode == 0, f"demo failed:\n{out[-6000:]}"
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("demo")
    summary = demo(
        run_dir, "--rl-seconds", str(RL_SECONDS), "--rl-steps", "130", "--max-staleness", "1",
        "--target-accuracy", str(TARGET + MARGIN), "--eval-size", EVAL_SIZE,
        timeout=RL_SECONDS + 420,
    )  # fmt: skip
    return run_dir, summary


@pytest.mark.timeout(RL_SECONDS + 600)
def test_async_grpo_reaches_090_within_5_minutes(async_run: tuple[Path, dict]) -> None:
    run_dir, s = async_run
    print(json.dumps(s, indent=2))
    assert s["accuracy_after"] >= TARGET, s
    assert s["accuracy_after"] - s["accuracy_before"] >= 0.25, s
    assert s["rl_seconds"] <= RL_SECONDS + 30, s
    assert 0 < s["best_step"] <= s["rl_steps"], s  # the best evaluation's weights, scored
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained == list(range(1, len(trained) + 1))  # every step once, in order
    assert all(r["staleness_max"] <= 1 for r in rows if "staleness_max" in r)
    assert (run_dir / "reward.png").stat().st_size > 10_000


@pytest.mark.timeout(RL_SECONDS + 900)  # includes the module fixture if it runs first
def test_synchronous_grpo_also_learns(async_run: tuple[Path, dict]) -> None:
    run_dir, first = async_run
    target = first["accuracy_before"] + SYNC_GAIN + MARGIN
    s = demo(run_dir, "--keep", "--max-staleness", "0", "--rl-seconds", "90",
             "--rl-steps", "130", "--target-accuracy", f"{target:.3f}",
             "--eval-size", EVAL_SIZE, timeout=90 + 180)  # fmt: skip
    print(json.dumps(s, indent=2))
    assert s["accuracy_before"] == first["accuracy_before"]  # the same SFT start
    assert s["accuracy_after"] >= s["accuracy_before"] + SYNC_GAIN, s
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness_max"] == 0 for r in rows if "staleness_max" in r)

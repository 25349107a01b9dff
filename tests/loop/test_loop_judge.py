"""The judge's verdicts drive training: a short real run in which the judge reward rises.

The whole loop as `flywheel up` plans and supervises it (tests/harness/stack.py:
a CPU engine with its rollout worker, sync, trainer, buffer, real
nats-server), and a task whose only reward is an LLM judge part. A tiny
model is no judge, so the judge is a real HTTP server written for the test
(tests/harness/judge.py) that answers /v1/chat/completions in SGLang's shape
by a rule a tiny policy can learn in a few steps: 10 x the share of digits
in the completion it is asked about. Nothing else rewards the policy, so
a rise in the trainer's batch reward is the judge's verdicts training it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.stack.localdev.nats_server import NatsServer
from tests.harness.judge import RUBRIC, JudgeServer, in_thread
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table

RUN = "judgeloop"
STEPS = 16
pytestmark = pytest.mark.slow


def digits(text: str) -> str:
    return f"Score: {10 * sum(c.isdigit() for c in text) / max(len(text), 1):.1f}"


def config(root: Path, model: Path, judge_url: str) -> str:
    return run_file(
        RUN,
        stack=stack_table(root, model, engines=1),
        buffer={"samples_per_prompt": 8, "groups_per_step": 4, "max_new_tokens": 4,
                "max_staleness": 1, "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 4, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
        engine={"num_threads": 1},
        judge={"urls": [judge_url], "engines": 0, "concurrency": 8, "timeout_s": 10.0},
        trainer={"publish_every": 1, "keep_checkpoints": 1, "max_steps": STEPS,
                 "runtime": {"cpu_threads": 1}, "optim": {"lr": 1e-2}},
        sync={"liveness_s": 3.0, "tick_s": 0.1, "retry_backoff_s": 0.2, "keep_last": 2},
    ) + f"""
[task]
source = {{ type = "arithmetic", digits = 1 }}
[[task.reward]]
type = "judge"
name = "digits"
rubric = {json.dumps(RUBRIC)}
"""  # fmt: skip


def test_judge_verdicts_drive_training(tiny_model: Path, tmp_path: Path) -> None:
    judge = JudgeServer(rule=digits)
    root = tmp_path / "run"
    with in_thread(judge) as url, NatsServer(store_dir=tmp_path / "nats") as nats:
        cfg = tmp_path / "run.toml"
        cfg.write_text(config(root, tiny_model, url))
        with Stack(cfg, nats.url) as st, printing_logs_on_failure(st):
            st.start("engine-0", "rollout-0")  # the worker waits for its engine
            st.start("sync", "trainer")
            st.start("buffer")
            wait_for(lambda: st.trained_steps() >= STEPS, timeout_s=600, what="training steps")
            rows = sorted(st.trained_rows(), key=lambda r: int(r["step"]))
    rewards = [float(r["reward_mean"]) for r in rows]
    assert all(r["reward/digits"] == r["reward_mean"] for r in rows)  # the judge's part alone
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    print(f"judge reward by step: {[round(x, 3) for x in rewards]}")
    assert last > first + 0.3, rewards
    # every sample was judged, through the pool: the judge saw each distinct completion
    assert judge.requests > 0


def test_flywheel_up_starts_the_judge_engines_and_the_workers_ask_them(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`[judge] engines = 1`: the plan's judge-0 (a CPU engine on the base model) starts
    first, and the worker, told its URL by the plan, sends it every judge request. (The
    tiny model is no judge: whether its replies hold a verdict is not the point here.)"""
    root = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    text = config(root, tiny_model, "http://unused:1").replace(
        'judge]\nurls = ["http://unused:1"]\nengines = 0', "judge]\nengines = 1"
    )
    assert "engines = 1\nconcurrency = 8" in text
    cfg.write_text(text)
    with NatsServer(store_dir=tmp_path / "nats") as nats, Stack(cfg, nats.url) as st:
        assert [p for p in st.names if p.startswith("judge")] == ["judge-0"]
        judge = st.proc("judge-0")
        with printing_logs_on_failure(st):
            st.start("judge-0", "engine-0")
            st.start("rollout-0")
            st.start("buffer")
            worker = st.proc("rollout-0")
            label = f'engine="{judge.url}",outcome="ok"'
            asked = wait_for(lambda: worker.metric("flywheel_judge_requests_total", label),
                             timeout_s=120, what="judge requests to judge-0")  # fmt: skip
    assert asked >= 1

"""A reward that times out on a right answer: that sample never reaches the trainer.

Real verifier sandbox processes with a real time limit score completions
through the rollout worker's own scoring step (`RolloutWorker.score_group`)
and make its samples and group (`rollout/core.py`); the real buffer service
(a subprocess, against a real nats-server) assembles them. What is checked
is what reaches the trainer: the TrainBatch on the BATCHES stream, and the
trainer's tensors made from it (`trainer/wire.py`). Before, a timed-out
check scored 0 and was trained on as a wrong answer, pushing a right answer
down; a group whose checks mostly failed trained on what was left.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import nats
from prometheus_client import CollectorRegistry

from proto.codec import decode
from proto.messages import DeadLetter, PromptTask, SampleGroup, TrainBatch
from proto.streams import consumers_for, stream_name, streams_for
from proto.subjects import Subjects
from services.engine_api.engine_client import GenerateResult
from services.rollout.app import PromptTaskScorer
from services.rollout.core import Origin, make_group, make_sample
from services.rollout.metrics import RolloutMetrics
from services.rollout.worker import RolloutWorker
from services.runtime.nats_conn import ensure_consumer, ensure_streams
from services.runtime.publish import publish
from services.sandbox import VerifierPool
from services.stack.localdev.nats_server import NatsServer
from services.tasks.scoring import Scorer
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet
from services.trainer.core.advantages import compute_advantages
from services.trainer.wire import to_tensor_batch
from tests.harness.ports import free_port
from tests.harness.sandbox import TESTS
from tests.integration.buffer.test_buffer_service import read_all, start_buffer

RUN = "unscored"
REWARD = "tests.integration.rollout.bad_verifiers:slow_when_right"
LIMIT_S = 1.5  # the verifier pool's time limit (a quick check must pass it on a loaded box)


def run_file(tmp_path: Path, url: str, metrics_port: int) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(f"""
run = "{RUN}"
[nats]
url = "{url}"
[task]
source = {{ type = "arithmetic", size = 50 }}
reward = "{REWARD}"
[buffer]
metrics_port = {metrics_port}
groups_per_step = 1
max_staleness = 0
oversample = 1.0
samples_per_prompt = 8
dispatch_interval_s = 0.05
""")
    return p


def completions(answer: str, slow: int) -> list[str]:
    """8 completions: `slow` right answers whose check times out, 2 right answers
    checked at once (when `slow` leaves room), the rest wrong."""
    fast_right = [answer] * min(2, 8 - slow)
    wrong = [answer + "1", answer + "2", answer + "3", "0", "1", "2"]
    return ([answer + " "] * slow + fast_right + wrong)[:8]


async def answer_tasks(js: object, max_payload: int, stop: asyncio.Event) -> list[SampleGroup]:
    """The rollout side: the first task's group has 2 timed-out right answers (6 scored),
    every later one 5 (3 scored: too few of 8)."""
    spec = TaskSpec.model_validate({"source": {"type": "arithmetic", "size": 50}, "reward": REWARD})
    tasks = TaskSet({"arithmetic": spec}, {"arithmetic": "[task]"})
    sent: list[SampleGroup] = []
    sub = await js.pull_subscribe_bind("rollout", stream_name(RUN, "TASKS"))  # type: ignore[attr-defined]
    async with VerifierPool(size=2, timeout_s=LIMIT_S, sandbox=TESTS) as pool:
        worker = RolloutWorker.__new__(RolloutWorker)  # only its scoring step
        worker.metrics = RolloutMetrics(CollectorRegistry())
        worker.warned_errors = set()
        worker.scorer = PromptTaskScorer(Scorer(tasks, pool))
        while not stop.is_set():
            try:
                msgs = await sub.fetch(1, timeout=0.2)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            task = decode(msgs[0].data, PromptTask)
            texts = completions(str(task.answer), slow=2 if not sent else 5)
            rewards = await worker.score_group(task, [(t, len(t)) for t in texts])
            gid = f"{task.task_id}:a{task.attempt}"
            origin = Origin("engine-0", 0, time.time())
            samples = tuple(
                make_sample(task, gid, i, [1, 2, 3], generated(t), r, origin)
                for i, (t, r) in enumerate(zip(texts, rewards, strict=True))
            )
            group = make_group(RUN, task, gid, samples, "worker-0")
            await publish(js, Subjects(RUN).samples, group, max_payload)  # type: ignore[arg-type]
            await msgs[0].ack()
            sent.append(group)
    return sent


def generated(text: str) -> GenerateResult:
    ids = [3 + ord(c) % 40 for c in text]
    return GenerateResult(
        rid="r", text=text, output_ids=ids, logprobs=[-0.5] * len(ids), finish_type="stop",
        finish_reason={"type": "stop"}, prompt_tokens=3, completion_tokens=len(ids),
        weight_version=0, e2e_latency=0.1,
    )  # fmt: skip


async def stored(js: object, what: str) -> list[bytes]:
    """Every message of the run's `what` stream ([] while it has none)."""
    info = await js.stream_info(stream_name(RUN, what))  # type: ignore[attr-defined]
    return await read_all(js, stream_name(RUN, what)) if info.state.messages else []


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_a_reward_that_times_out_on_a_right_answer_leaves_that_sample_out_of_the_batch(
    tmp_path: Path,
) -> None:
    with NatsServer() as server:
        asyncio.run(asyncio.wait_for(_scenario(tmp_path, server.url), 150))


async def _scenario(tmp_path: Path, url: str) -> None:
    port = free_port()
    log = tmp_path / "buffer.log"
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    await ensure_consumer(js, consumers_for(RUN)["rollout"])
    stop = asyncio.Event()
    rollout = asyncio.create_task(answer_tasks(js, nc.max_payload, stop))
    proc = start_buffer(run_file(tmp_path, url, port), log)
    try:
        deadline = time.monotonic() + 120
        while True:  # one batch, and one group dead-lettered for its failed checks
            batches = await stored(js, "BATCHES")
            dead = await stored(js, "DLQ")
            if batches and dead:
                break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            assert proc.poll() is None and not rollout.done(), log.read_text()[-3000:]
            await asyncio.sleep(0.1)
        unscored_total = scrape(port, "flywheel_buffer_unscored_samples_total")
    finally:
        stop.set()
        sent = await rollout
        proc.terminate()
        proc.wait(timeout=20)
        await nc.close()

    first, second = sent[0], sent[1]
    answer = first.samples[2].response_ids  # a right answer checked at once
    timed_out = [s for s in first.samples if s.verifier_error]
    assert len(timed_out) == 2 and all("timed out" in (s.verifier_error or "") for s in timed_out)
    assert all(s.reward == 0.0 for s in timed_out)  # as the worker sends them

    batch = decode(batches[0], TrainBatch)
    [group] = batch.groups
    assert group.group_id == first.group_id
    assert [s.index for s in group.samples] == [2, 3, 4, 5, 6, 7]  # 0, 1 timed out
    assert all(s.verifier_error is None for s in group.samples)
    assert [s.reward for s in group.samples] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert group.samples[0].response_ids == answer

    # The trainer's tensors: six samples, and the baseline is theirs alone (mean 1/3:
    # the right answers up, the wrong ones down; the timed-out ones are not there).
    core = to_tensor_batch(batch)
    assert len(core.response_ids) == 6
    adv = compute_advantages(core.rewards, core.group_ids, "grpo")
    assert (adv[:2] > 0).all() and (adv[2:] < 0).all()
    assert abs(float(core.rewards.mean()) - 1 / 3) < 1e-6

    letters = [decode(d, DeadLetter) for d in dead]
    [letter] = [d for d in letters if d.reason == "unscored"]
    assert decode(letter.payload, SampleGroup).group_id == second.group_id
    assert "5 of 8 rewards could not be computed" in letter.error
    assert unscored_total >= 2 + 5

"""A JSONL task through the real rollout worker: the buffer's tasks in, scored groups out.

Real nats-server, a real CPU engine serving a tiny model whose BPE tokenizer
was trained on the task's text (chat template and all), the real rollout
service (`run_service` with the rollout body, in this process, as in
test_worker_engine.py) with its sandboxed verifier pool. The PromptTasks
are the buffer's own (`BufferService.make_task` on the same run file), so
the task name and row travel as they do in a run; every sample's reward
parts are checked against the reward functions computed here, and a task
naming a task the run file lacks is dead-lettered as `unknown_task`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from proto.messages import DeadLetter, SampleGroup, unpack_i32
from proto.streams import stream_name, streams_for
from proto.subjects import Subjects
from services.buffer.app import BufferService
from services.buffer.settings import BufferSettings
from services.models.tiny_model import build_bpe_tokenizer, write_tiny_model
from services.rollout.app import body as rollout_body
from services.rollout.settings import RolloutSettings
from services.runtime.lifecycle import run_service
from services.runtime.nats_conn import connect, ensure_streams
from services.runtime.publish import publish
from services.runtime.settings import NatsSettings, load_settings
from services.stack.localdev.nats_server import NatsServer
from services.tasks import rewards
from tests.harness.engines import EngineStates, serving_engine
from tests.harness.poll import eventually
from tests.harness.runfile import run_file
from tests.harness.streams import read_stream_async

RUN = "jsonltask"
S = Subjects(RUN)


class _Ctx:
    """What BufferService.make_task needs of a service context: a metrics registry (and, for
    its dead-letter publisher, NATS: make_task publishes nothing)."""

    registry = CollectorRegistry()
    js = None
    max_payload = 1024 * 1024


def test_worker_scores_a_jsonl_task_through_the_pool(tmp_path: Path) -> None:
    rows = [
        {
            "question": f"Ana has {i} apples and buys 2 more. How many?",
            "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}",
        }
        for i in range(6)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [r["question"] for r in rows] + [r["answer"] for r in rows]
    tok = build_bpe_tokenizer(texts * 20, vocab_size=300)
    model = write_tiny_model(tmp_path / "model", tokenizer=tok)
    config = tmp_path / "run.toml"
    config.write_text(
        run_file(
            RUN,
            buffer={"samples_per_prompt": 3, "max_new_tokens": 8},
            rollout={"concurrency": 4, "heartbeat_s": 0.3},
            engine={"num_threads": 1},
        )
        + f"""
[task]
source = {{ type = "jsonl", path = "{data}", prompt_field = "question", answer_marker = "####" }}
[[task.reward]]
fn = "math"
[[task.reward]]
fn = "soft_overlong"
max_tokens = 6
buffer_tokens = 4
weight = 0.5
"""
    )
    engines = EngineStates(model)
    try:
        with NatsServer() as nats:
            sent, groups, dead = asyncio.run(
                asyncio.wait_for(serve_and_roll_out(nats.url, config, engines, model), 120)
            )
    finally:
        engines.close()
    answers = {t["task_id"]: t["answer"] for t in sent}
    assert {g.task_id for g in groups} == {t["task_id"] for t in sent[:-1]}
    for g in groups:
        assert g.task_name == "jsonl"
        for s in g.samples:
            text = tok.decode(unpack_i32(s.response_ids).tolist(), skip_special_tokens=True)
            n = s.num_response_tokens
            math = rewards.math_answer(text, answers[g.task_id])
            overlong = rewards.soft_overlong(n, max_tokens=6, buffer_tokens=4)
            assert s.verifier_error is None, s.verifier_error
            assert s.reward_parts == {"math": math, "soft_overlong": overlong}, (text, n)
            assert abs(s.reward - (math + 0.5 * overlong)) < 1e-9
    assert [d.reason for d in dead] == ["unknown_task"]
    assert "not in this run file's task spec" in dead[0].error


async def serve_and_roll_out(
    url: str, config: Path, engines: EngineStates, model: Path
) -> tuple[list[dict[str, Any]], list[SampleGroup], list[DeadLetter]]:
    """The engine and the rollout worker in this process; the buffer's tasks in; the
    groups and dead letters out, read from the streams."""
    from proto.codec import decode

    async with serving_engine(engines.get()) as engine_url:
        settings = load_settings(
            RolloutSettings, config, nats=NatsSettings(url=url, connect_attempts=3),
            engine_url=engine_url, engine_id="engine-0", worker_id="rollout-0", model=model,
            weights_dir=model.parent / "engine-weights",
        )  # fmt: skip
        stop = asyncio.Event()
        service = asyncio.create_task(run_service("rollout", settings, rollout_body, stop=stop,
                                                  registry=CollectorRegistry(),
                                                  handle_signals=False))  # fmt: skip
        try:
            sent = await publish_tasks(url, config)
            samples, dlq = stream_name(RUN, "SAMPLES"), stream_name(RUN, "DLQ")
            await eventually(lambda: _count(url, samples, S.samples, len(sent) - 1), 60)
            await eventually(lambda: _count(url, dlq, S.dlq_all, 1), 30)
        finally:
            stop.set()
            await asyncio.wait_for(service, 30)
        groups = [decode(b, SampleGroup) for b in await read_stream_async(url, samples, S.samples)]
        dead = [decode(b, DeadLetter) for b in await read_stream_async(url, dlq, S.dlq_all)]
    return sent, groups, dead


async def _count(url: str, stream: str, subject: str, at_least: int) -> bool:
    return len(await read_stream_async(url, stream, subject)) >= at_least


async def publish_tasks(url: str, config: Path) -> list[dict[str, Any]]:
    """Four of the buffer's tasks (rows of the JSONL task), then one naming no task."""
    settings = load_settings(BufferSettings, config)
    svc: Any = BufferService(_Ctx(), settings, store=None)  # type: ignore[arg-type]
    nc = await connect(NatsSettings(url=url, connect_attempts=3), "test")
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    tasks = [svc.make_task(0, i) for i in range(4)]
    tasks.append(tasks[0].model_copy(update={"task_id": f"{RUN}:e9:i0", "task_name": "gsm9k"}))
    for t in tasks:
        await publish(js, S.tasks, t, nc.max_payload)
    await nc.close()
    # the row each task names is the row whose answer it carries
    assert [t.answer for t in tasks[:4]] == [str(int(t.index) + 2) for t in tasks[:4]]
    return [{"task_id": t.task_id, "answer": t.answer} for t in tasks]

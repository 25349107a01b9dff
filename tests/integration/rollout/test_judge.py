"""The LLM judge as a reward part: its engine pool, and the rollout worker that judges.

Real servers throughout: the CPU engine (a tiny model) answering
/v1/chat/completions at temperature 0 within max_tokens; judge servers
written here (tests/harness/judge.py: aiohttp, SGLang's chat answer shape)
that hang, answer garbage, or grade by a rule, counting what they receive;
a real nats-server and the real rollout service (in this process, as
test_task_rollout.py runs it) whose task mixes exact_match with a judge.

- the pool spreads requests over its engines, never has more than
  `concurrency` in flight, and retries a hung engine on another;
- a judge that hangs: each sample is unscored (`verifier_error`) and
  dead-lettered as `judge_timeout`; one that answers garbage: as
  `judge_unparsable`; the worker goes on and scores the next task;
- a cache hit skips the engine: the same prompt's equal completions ask
  the judge once, and not at all the second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proto.codec import decode
from proto.messages import DeadLetter, PromptTask, SampleGroup, SamplingParams
from proto.streams import stream_name, streams_for
from proto.subjects import Subjects
from services.engine_api.chat_pool import ChatFailed, ChatPool
from services.rollout.app import body as rollout_body
from services.rollout.settings import RolloutSettings
from services.runtime.lifecycle import run_service
from services.runtime.nats_conn import connect, ensure_streams
from services.runtime.publish import publish
from services.runtime.settings import NatsSettings, load_settings
from services.stack.localdev.nats_server import NatsServer
from tests.harness.engines import EngineStates, serving, serving_engine
from tests.harness.judge import RUBRIC, JudgeServer, Tally
from tests.harness.poll import eventually
from tests.harness.runfile import run_file
from tests.harness.streams import read_stream_async

RUN = "judged"
S = Subjects(RUN)


def chat_body(text: str = "1+1=", max_tokens: int = 4) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0}  # fmt: skip


# ── the pool ────────────────────────────────────────────────────────────────────
def test_the_cpu_engine_answers_a_greedy_bounded_chat(tiny_model: Path) -> None:
    """What a judge part sends, the CPU engine serves: temperature 0 is greedy (the same
    reply twice), max_tokens bounds it."""
    engines = EngineStates(tiny_model)

    async def body() -> tuple[list[str], Any]:
        async with serving_engine(engines.get()) as url, ChatPool([url]) as pool:
            replies = [await pool.chat(chat_body()) for _ in range(2)]
            raw = await pool.clients[0].request("POST", "/v1/chat/completions", chat_body())
        return replies, raw

    try:
        replies, raw = asyncio.run(body())
    finally:
        engines.close()
    assert replies[0] == replies[1]
    assert raw["object"] == "chat.completion" and raw["usage"]["completion_tokens"] <= 4
    assert raw["choices"][0]["message"]["content"] == replies[0]


def test_pool_spreads_the_load_and_honours_its_concurrency() -> None:
    both = Tally()
    a, b = JudgeServer(delay_s=0.1, tally=both), JudgeServer(delay_s=0.1, tally=both)

    async def body() -> list[str]:
        async with serving(a.app()) as ua, serving(b.app()) as ub:
            async with ChatPool([ua, ub], concurrency=3) as pool:
                return await asyncio.gather(*(pool.chat(chat_body()) for _ in range(12)))

    replies = asyncio.run(body())
    assert replies == ["score: 5"] * 12
    assert a.requests + b.requests == 12 and min(a.requests, b.requests) >= 4
    assert both.most == 3  # the pool's limit, reached and never passed


def test_more_judge_engines_judge_more() -> None:
    """Engines that answer one request at a time: two work on answers at once, each
    taking its share of 8, the pool's concurrency being no limit. (Counted by the servers,
    not timed: a wall-clock ratio failed under make test's load.)"""

    async def spread(engines: int) -> tuple[int, list[int]]:
        working = Tally()
        servers = [JudgeServer(delay_s=0.2, capacity=1, working=working) for _ in range(engines)]
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(serving(s.app())) for s in servers]
            async with ChatPool(urls, concurrency=8) as pool:
                await asyncio.gather(*(pool.chat(chat_body()) for _ in range(8)))
        return working.most, [s.requests for s in servers]

    (one, [alone]), (two, shares) = asyncio.run(spread(1)), asyncio.run(spread(2))
    assert (one, alone) == (1, 8), (one, alone)
    assert two == 2 and sum(shares) == 8 and min(shares) >= 3, (two, shares)


def test_a_hung_engine_is_retried_on_another_and_a_hung_pool_fails_in_bounded_time() -> None:
    hung, good = JudgeServer(mode="hang"), JudgeServer()

    async def body() -> tuple[list[str], float, ChatFailed]:
        async with serving(hung.app()) as uh, serving(good.app()) as ug:
            async with ChatPool([uh, ug], timeout_s=0.5, retries=1, backoff_s=0.0) as pool:
                replies = await asyncio.gather(*(pool.chat(chat_body()) for _ in range(4)))
            async with ChatPool([uh], timeout_s=0.3, retries=2, backoff_s=0.0) as dead:
                t0 = time.monotonic()
                with pytest.raises(ChatFailed) as err:
                    await dead.chat(chat_body())
                return replies, time.monotonic() - t0, err.value

    replies, took, err = asyncio.run(body())
    assert replies == ["score: 5"] * 4 and hung.requests >= 1
    assert err.reason == "timeout" and "3 attempts" in str(err), err
    assert took < 3.0


def test_a_refusal_is_not_retried() -> None:
    refusing = JudgeServer(mode="refuse")

    async def body() -> ChatFailed:
        async with serving(refusing.app()) as url, ChatPool([url], retries=3) as pool:
            with pytest.raises(ChatFailed) as err:
                await pool.chat(chat_body())
            return err.value

    err = asyncio.run(body())
    assert err.reason == "refused" and "400" in str(err) and refusing.requests == 1


# ── the rollout worker that judges ──────────────────────────────────────────────
def digits_rule(text: str) -> str:
    """10 x the share of digits in the completion."""
    return f"score: {10 * sum(c.isdigit() for c in text) / max(len(text), 1):.2f}"


def config_for(tmp_path: Path, judge_url: str) -> Path:
    config = tmp_path / "run.toml"
    judge = {"urls": [judge_url], "timeout_s": 0.5, "retries": 1, "backoff_s": 0.0,
             "concurrency": 2}  # fmt: skip
    config.write_text(
        run_file(
            RUN,
            rollout={"concurrency": 4, "heartbeat_s": 0.3},
            engine={"num_threads": 1},
            judge=judge,
        )
        + f"""
[task]
source = {{ type = "arithmetic", digits = 1 }}
[[task.reward]]
fn = "exact_match"
[[task.reward]]
type = "judge"
name = "digits"
weight = 0.5
rubric = {json.dumps(RUBRIC)}
"""
    )
    return config


def task(i: int, index: int) -> PromptTask:
    """n = 3 greedy completions of one prompt: equal, so they ask the judge once."""
    return PromptTask(
        run=RUN, task_id=f"{RUN}:e0:i{i}", epoch=0, index=index, task_name="arithmetic",
        prompt=f"{index}+1=", answer=str(index + 1), n=3,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=4), created_at=time.time(),
    )  # fmt: skip


def test_worker_dead_letters_what_the_judge_cannot_score_and_caches_verdicts(
    tmp_path: Path, tiny_model: Path
) -> None:
    judge = JudgeServer(rule=digits_rule)
    engines = EngineStates(tiny_model)
    registry = CollectorRegistry()
    try:
        with NatsServer() as nats:
            rolled = roll_out(nats.url, tmp_path, tiny_model, engines, judge, registry)
            groups, dead, asked = asyncio.run(asyncio.wait_for(rolled, 180))
    finally:
        engines.close()
    by_task = {g.task_id: g for g in groups}
    hung, garbled, scored, again = (by_task[f"{RUN}:e0:i{i}"] for i in range(4))
    # a hung judge and a garbling one: every sample unscored, with the reason; no reward
    for g, why in ((hung, "no answer in 0.5s"), (garbled, "no verdict")):
        for s in g.samples:
            assert s.verifier_error is not None and why in s.verifier_error, s.verifier_error
            assert s.reward == 0.0
    reasons = sorted(d.reason for d in dead)
    assert reasons == ["judge_timeout"] * 3 + ["judge_unparsable"] * 3, reasons
    assert all(d.service == "rollout" and d.subject == S.tasks for d in dead)
    assert any("lorem" in d.error for d in dead if d.reason == "judge_unparsable")
    # the worker went on: the next task is judged, its verdict in the weighted sum
    for g in (scored, again):
        for s in g.samples:
            assert s.verifier_error is None
            assert 0.0 <= s.reward_parts["digits"] <= 1.0
            assert s.reward == pytest.approx(s.reward_parts["exact_match"]
                                             + 0.5 * s.reward_parts["digits"])  # fmt: skip
    # three equal completions asked the judge once; the same prompt again, not at all
    assert asked == {"scored": 1, "again": 0}, asked
    text = generate_latest(registry).decode()
    for line in (
        'flywheel_judge_unscored_total{reason="judge_timeout"} 3.0',
        'flywheel_judge_unscored_total{reason="judge_unparsable"} 3.0',
        # garbage and scored: 1 asked + 2 shared in flight each; again: 3 from the cache
        "flywheel_judge_cache_hits_total 7.0",
        "flywheel_judge_cache_misses_total 2.0",
    ):
        assert line in text, line
    assert "flywheel_judge_request_seconds_bucket" in text
    assert "flywheel_judge_waiting 0.0" in text and "flywheel_judge_in_flight 0.0" in text


async def roll_out(
    url: str,
    tmp_path: Path,
    model: Path,
    engines: EngineStates,
    judge: JudgeServer,
    registry: CollectorRegistry,
) -> tuple[list[SampleGroup], list[DeadLetter], dict[str, int]]:
    samples, dlq = stream_name(RUN, "SAMPLES"), stream_name(RUN, "DLQ")
    asked: dict[str, int] = {}
    async with serving(judge.app()) as judge_url, serving_engine(engines.get()) as engine_url:
        settings = load_settings(
            RolloutSettings, config_for(tmp_path, judge_url),
            nats=NatsSettings(url=url, connect_attempts=3), engine_url=engine_url,
            engine_id="engine-0", worker_id="rollout-0", model=model,
            weights_dir=tmp_path / "engine-weights",
        )  # fmt: skip
        stop = asyncio.Event()
        service = asyncio.create_task(run_service("rollout", settings, rollout_body, stop=stop,
                                                  registry=registry,
                                                  handle_signals=False))  # fmt: skip
        nc = await connect(NatsSettings(url=url, connect_attempts=3), "test")
        js = nc.jetstream()
        await ensure_streams(js, streams_for(RUN))

        async def one(i: int, index: int, mode: str) -> int:
            judge.mode = mode
            before = judge.requests
            await publish(js, S.tasks, task(i, index), nc.max_payload)
            await eventually(lambda: _count(url, samples, S.samples, i + 1), 60)
            return judge.requests - before

        try:
            await one(0, 3, "hang")
            await one(1, 4, "garbage")
            asked["scored"] = await one(2, 5, "rule")
            asked["again"] = await one(3, 5, "rule")  # the same prompt: a new task id
            await eventually(lambda: _count(url, dlq, S.dlq_all, 6), 30)
        finally:
            await nc.close()
            stop.set()
            await asyncio.wait_for(service, 30)
        groups = [decode(b, SampleGroup) for b in await read_stream_async(url, samples, S.samples)]
        dead = [decode(b, DeadLetter) for b in await read_stream_async(url, dlq, S.dlq_all)]
    return groups, dead, asked


async def _count(url: str, stream: str, subject: str, at_least: int) -> bool:
    return len(await read_stream_async(url, stream, subject)) >= at_least

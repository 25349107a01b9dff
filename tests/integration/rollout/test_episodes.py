"""Multi-turn episodes with tools, against a real CPU engine, tool sandbox and nats-server.

The policy is a tiny model taught three scripts (tests/harness/scripted.py),
so what it generates is known: "7*8=" calls the calculator twice and
answers; "S=" calls a tool that hangs; "B=" one that raises.

- one episode with two tool calls is one sample whose tokens are exactly
  the engine's generated tokens and the observations, in order, with loss
  mask 0 exactly on the observations and the engine's logprobs exactly on
  the generated tokens (checked against the model's own, recomputed);
- the worker publishes it through NATS with its episode figures, and a
  hung and a raising tool each cost their turn an error observation: the
  episode goes on, and the worker goes on to the next task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM, AutoTokenizer

from proto.codec import decode, encode, message_id
from proto.messages import (
    PromptTask,
    SampleGroup,
    SamplingParams,
    unpack_f32,
    unpack_i32,
    unpack_u8,
)
from proto.streams import streams_for
from proto.subjects import Subjects
from services.engine_api.engine_client import EngineClient
from services.models.tiny_model import build_tokenizer
from services.rollout.app import body as rollout_body
from services.rollout.episodes import EpisodeRunner
from services.rollout.settings import RolloutSettings
from services.runtime.lifecycle import run_service
from services.runtime.nats_conn import ensure_streams
from services.runtime.settings import NatsSettings
from services.sandbox import ToolPool
from services.stack.localdev.nats_server import NatsServer
from services.tasks.episode import TurnOutput
from services.tasks.episode_spec import EpisodeSpec
from services.tasks.evaluate import evaluate_dir
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet
from tests.harness.engines import EngineStates, serving_engine
from tests.harness.sandbox import TESTS
from tests.harness.scripted import write_scripted_model

TOK = build_tokenizer()
FN = "tests.unit.tasks.tool_fixtures"
SCRIPTS = [
    ("7*8=", "<calc>7*8</calc><result>56</result>\n<calc>56+1</calc><result>57</result>\n"
             "<answer>57</answer>"),
    ("S=", "<slow>{}</slow><result>error: x</result>\n<answer>0</answer>"),
    ("B=", "<boom>{}</boom><result>error: x</result>\n<answer>0</answer>"),
]  # fmt: skip
EPISODE = {
    "tools": [
        {"type": "calculator"},
        {"type": "function", "tag": "slow", "fn": f"{FN}:hang"},
        {"type": "function", "tag": "boom", "fn": f"{FN}:boom"},
    ],
    "max_turns": 4,
    "max_tokens": 120,
    "tool_timeout_s": 1.0,
}
TASK = {
    "source": {"type": "arithmetic"},
    "reward": {"fn": "exact_match", "extract": "answer_tag"},
    "episode": EPISODE,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripted_model(tmp_path_factory.mktemp("episodes") / "model", SCRIPTS)


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[EngineStates]:
    states = EngineStates(model_dir)
    yield states
    states.close()


def test_two_tool_calls_make_one_sample_of_exactly_what_the_engine_saw(
    engines: EngineStates, model_dir: Path, run_async: Any
) -> None:
    spec = EpisodeSpec.model_validate(EPISODE)
    prompt = TOK.encode("7*8=")
    turns: list[TurnOutput] = []

    async def body() -> Any:
        async with serving_engine(engines.get()) as url, EngineClient(url) as c, \
                ToolPool(size=1, timeout_s=1.0, sandbox=TESTS) as tools:  # fmt: skip
            runner = EpisodeRunner(c, tools, TOK.encode, 30.0, 0, lambda: None)
            engine_turn = runner.turn

            async def recorded(
                ids: list[int], params: dict[str, Any], rid: str, lora_path: str | None = None
            ) -> TurnOutput:
                out = await engine_turn(ids, params, rid, lora_path)
                turns.append(out)
                return out

            runner.turn = recorded  # type: ignore[method-assign]
            params = {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 40}
            return await runner.episode(spec, prompt, params, "ep")

    ep = run_async(body(), timeout_s=60)
    assert ep.tool_calls == 2 and ep.tool_errors == 0 and ep.turns == 3, ep.text
    assert ep.text.endswith("<answer>57</answer>"), ep.text
    obs = [TOK.encode("<result>56</result>\n"), TOK.encode("<result>57</result>\n")]
    t = [o.ids for o in turns]
    assert ep.response_ids == t[0] + obs[0] + t[1] + obs[1] + t[2]
    assert ep.loss_mask == [1] * len(t[0]) + [0] * len(obs[0]) + [1] * len(t[1]) + [0] * len(
        obs[1]
    ) + [1] * len(t[2])
    engine_lp = [lp for o in turns for lp in o.logprobs]
    policy = torch.tensor(ep.loss_mask, dtype=torch.bool)
    got = torch.tensor(ep.logprobs)
    assert got[policy].tolist() == engine_lp  # the engine's own numbers, untouched
    assert (got[~policy] == 0).all()
    # ... and they are the model's logprobs of those tokens in that context.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ep.response_ids])).logits[0] / 0.8
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    expected = logp.gather(-1, torch.tensor(ep.response_ids)[:, None]).squeeze(-1)
    assert torch.allclose(got[policy], expected[policy], atol=1e-4, rtol=0)


def task(run: str, i: int, prompt: str, answer: str) -> PromptTask:
    sp = SamplingParams(max_new_tokens=40, temperature=0.8)
    return PromptTask(run=run, task_id=f"{run}:e0:i{i}", epoch=0, index=i, task_name="arithmetic",
                      prompt=prompt, answer=answer, n=2, sampling=sp)  # fmt: skip


@asynccontextmanager
async def worker(
    nats_url: str, run: str, engine_url: str, model_dir: Path, reg: CollectorRegistry
) -> AsyncIterator[tuple[Any, list[SampleGroup]]]:
    settings = RolloutSettings(
        run=run, nats=NatsSettings(url=nats_url, connect_attempts=3), engine_url=engine_url,
        task=TASK, engine_id="engine-0", worker_id="rollout-0", model=model_dir,
        concurrency=3, heartbeat_s=0.2, weights_dir=model_dir.parent / "engine-weights",
    )  # fmt: skip
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(run))
    groups: list[SampleGroup] = []

    async def on_group(msg: Any) -> None:
        groups.append(decode(msg.data, SampleGroup))

    await nc.subscribe(Subjects(run).samples, cb=on_group)
    stop = asyncio.Event()
    service = asyncio.create_task(run_service("rollout", settings, rollout_body, stop=stop,
                                              registry=reg, handle_signals=False))  # fmt: skip
    try:
        yield js, groups
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
        await nc.close()


async def until(check: Any, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {check}"
        await asyncio.sleep(0.05)


def test_worker_runs_episodes_and_survives_hung_and_raising_tools(
    nats_server: NatsServer, engines: EngineStates, model_dir: Path, run_async: Any
) -> None:
    reg = CollectorRegistry()

    async def body() -> list[SampleGroup]:
        async with serving_engine(engines.get()) as url, \
                worker(nats_server.url, "ep", url, model_dir, reg) as (js, groups):  # fmt: skip
            for t in (task("ep", 0, "S=", "0"), task("ep", 1, "B=", "0")):
                await js.publish(Subjects("ep").tasks, encode(t),
                                 headers={"Nats-Msg-Id": message_id(t)})  # fmt: skip
            await until(lambda: len(groups) == 2)
            t = task("ep", 2, "7*8=", "57")  # the worker goes on after the broken tools
            await js.publish(
                Subjects("ep").tasks, encode(t), headers={"Nats-Msg-Id": message_id(t)}
            )
            await until(lambda: len(groups) == 3)
            return groups

    groups = {g.task_id: g for g in run_async(body(), timeout_s=120)}
    wtok = AutoTokenizer.from_pretrained(model_dir)  # the worker's tokenizer, as it loads it
    errors = (
        ("ep:e0:i0", "<result>error: timed out after 1.0s</result>\n"),
        ("ep:e0:i1", "<result>error: raised RuntimeError: the tool broke</result>\n"),
    )
    for tid, obs in errors:
        want = wtok(obs, add_special_tokens=False)["input_ids"]
        for s in groups[tid].samples:
            parts = s.reward_parts
            assert parts["episode.tool_errors"] == 1 and parts["episode.turns"] >= 2, parts
            ids, mask = unpack_i32(s.response_ids).tolist(), unpack_u8(s.loss_mask).tolist()
            at = len("<slow>{}</slow>")  # the call, then the error observation, masked
            assert ids[at : at + len(want)] == want, wtok.decode(ids)
            assert mask[:at] == [1] * at and mask[at : at + len(want)] == [0] * len(want)
            assert mask[at + len(want) :] and set(mask[at + len(want) :]) == {1}  # went on
    obs = wtok("<result>56</result>\n", add_special_tokens=False)["input_ids"]
    for s in groups["ep:e0:i2"].samples:
        mask = unpack_u8(s.loss_mask).tolist()
        assert s.reward == 1.0 and s.reward_parts["episode.tool_calls"] == 2
        assert mask.count(0) == 2 * len(obs)
        lp = unpack_f32(s.logprobs)
        assert all(lp[i] == 0 for i, m in enumerate(mask) if m == 0)
        assert all(lp[i] < 0 for i, m in enumerate(mask) if m == 1)
    assert (reg.get_sample_value("flywheel_rollout_tool_errors_total") or 0) == 4
    assert (reg.get_sample_value("flywheel_rollout_tool_calls_total") or 0) == 8


def test_held_out_evaluation_runs_the_same_episodes(model_dir: Path, tmp_path: Path) -> None:
    """evaluate_dir (the trainer's eval_every, `flywheel eval`, the demo) on a task with
    episodes: the model's greedy turns, the calculator's observations, the task's reward."""
    data = tmp_path / "held_out.jsonl"
    data.write_text('{"prompt": "7*8=", "answer": "57"}\n{"prompt": "B=", "answer": "1"}\n')
    source = {"type": "jsonl", "path": str(data)}
    spec = {**TASK, "eval": {"source": source, "max_new_tokens": 40}}
    tasks = TaskSet.from_fields(TaskSpec.model_validate(spec), {})
    report = evaluate_dir(model_dir, tasks)
    t = report.tasks["arithmetic"]
    assert report.split == "validation"  # no test source: `flywheel eval` says so
    assert (t.total, t.pass_at_1) == (2, 0.5)  # "B=" answers 0
    transcript = t.examples[0][1]
    assert transcript.count("<result>") == 2 and transcript.endswith("<answer>57</answer>")

"""verifiers v1 environments' episodes against the CPU engine's /v1/chat/completions
(extra: verifiers>=0.3.1; skipped without it).

A single-turn taskset (SingleAgentEnv) and a multi-turn env (its own Env:
the agent answers, the env asks twice more) run through V1Runner: every
model call is relayed by verifiers' interception server to Flywheel's
client, which asks the engine for token ids and logprobs, as SGLang serves
them. The sample is the trace's branch: the tokens the engine saw, the
env's turns masked out, the rubric's reward.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.tasks.verifiers_v1 import V1Runner, VerifiersV1Source
from tests.harness import REPO
from tests.harness.engines import EngineProcess, start_engine, stop_engine
from tests.harness.extras import require_verifiers_v1

require_verifiers_v1()

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 5}


@pytest.fixture(autouse=True)
def _envs_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures" / "verifiers_v1"))
    yield


def _run(run_async: Any, engine: EngineProcess, src: VerifiersV1Source, n: int) -> list[Any]:
    async def body() -> list[Any]:
        async with V1Runner(engine.url, str(engine.model_dir), 60.0, 2) as runner:
            return await runner.run(src, 1, n, SAMPLING)

    return run_async(body())


def test_a_single_turn_episode_is_the_engines_tokens_scored_by_the_rubric(
    run_async: Any, engine: EngineProcess
) -> None:
    src = VerifiersV1Source(type="verifiers-v1", taskset="fw-add-v1", args={"num_tasks": 2})
    tok: Any = AutoTokenizer.from_pretrained(engine.model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "input_ids") else prompt)
    for s in _run(run_async, engine, src, 2):
        ep = s.episode
        assert s.error is None, s.error
        assert ep.prompt_ids == prompt  # the engine's own template, as it saw it
        assert 1 <= len(ep.response_ids) <= 5 and ep.loss_mask == [1] * len(ep.response_ids)
        assert all(lp <= 0.0 for lp in ep.logprobs) and any(lp < 0.0 for lp in ep.logprobs)
        assert ep.text == tok.decode(ep.response_ids, skip_special_tokens=True).strip()
        assert s.reward == (1.0 if "3" in ep.text.split() else s.parts["verifiers.correct"])
        assert s.parts["verifiers.reply_chars"] == len(ep.text) and ep.turns == 1


def test_a_multi_turn_episode_keeps_every_turn_and_masks_the_envs(
    run_async: Any, engine: EngineProcess
) -> None:
    src = VerifiersV1Source(type="verifiers-v1", taskset="fw-recall-v1")
    tok: Any = AutoTokenizer.from_pretrained(engine.model_dir)
    for s in _run(run_async, engine, src, 2):
        ep = s.episode
        assert s.error is None, s.error
        assert ep.turns == 3 and s.parts["episode.turns"] == 3.0
        # sampled, env, sampled, env, sampled: three runs of 1s, two of 0s
        runs = [m for i, m in enumerate(ep.loss_mask) if i == 0 or m != ep.loss_mask[i - 1]]
        assert runs == [1, 0, 1, 0, 1]
        pairs = list(zip(ep.response_ids, ep.logprobs, ep.loss_mask, strict=True))
        ask = tok.decode(tok("Say it again.", add_special_tokens=False)["input_ids"])
        assert tok.decode([t for t, _, m in pairs if not m]).count(ask) == 2  # the env's turns
        assert {lp for _, lp, m in pairs if not m} == {0.0}  # the env's tokens: no logprob
        assert s.parts["verifiers.dropped_branches"] == 0.0
        assert 0.0 <= s.reward <= 1.0 and s.reward == s.parts["verifiers.repeated"]
        # The sample is the very sequence the engine saw: the model's own logprobs of it,
        # recomputed in one pass, are the engine's on every policy token of every turn.
        got = torch.tensor(ep.logprobs)
        policy = torch.tensor(ep.loss_mask, dtype=torch.bool)
        assert torch.allclose(got[policy], _recomputed(engine, ep)[policy], atol=1e-4, rtol=0)


def test_episodes_sample_as_the_task_says_not_as_the_model_card_does(
    run_async: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A model whose generation_config.json asks for top_k 1 and a repetition penalty:
    SGLang's chat route would apply both to what a request leaves out, so the client
    sends the task's sampling in full (top_k -1, no penalty, no min_p)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    gen = model / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "top_k": 1,
                               "repetition_penalty": 1.1}))  # fmt: skip
    eng = start_engine(model, tmp_path / "engine.log")
    try:
        src = VerifiersV1Source(type="verifiers-v1", taskset="fw-add-v1", args={"num_tasks": 2})
        samples = _run(run_async, eng, src, 4)
    finally:
        stop_engine(eng)
    assert all(s.error is None for s in samples), [s.error for s in samples]
    # top_k 1 would make every episode the greedy one
    assert len({tuple(s.episode.response_ids) for s in samples}) > 1


def _recomputed(engine: EngineProcess, ep: Any) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    ids = ep.prompt_ids + ep.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # temperature 1.0
    logp = torch.log_softmax(logits, -1)[len(ep.prompt_ids) - 1 : -1]
    return logp.gather(-1, torch.tensor(ep.response_ids)[:, None]).squeeze(-1)

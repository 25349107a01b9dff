"""The CPU engine's OpenAI-compatible routes, through the official `openai` client.

Against a real engine subprocess: responses validate as OpenAI's own types
(`ChatCompletion`, `Completion`), carry SGLang's extras (token ids,
weight-version metadata), and their per-token logprobs are the model's, as
a trainer recomputes them. What the engine cannot honour is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from services.models.tiny_model import build_tokenizer
from tests.harness.engines import EngineProcess
from tests.integration.engine.test_engine_server import raw, recompute_logprobs

TOK = build_tokenizer()


def client(engine: EngineProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def test_chat_completions_shape_ids_and_logprobs(run_async: Any, engine: EngineProcess) -> None:
    messages = [{"role": "user", "content": "12+34="}]

    async def body() -> tuple[ChatCompletion, dict[str, Any]]:
        async with client(engine) as c:
            typed = await c.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0.7, n=2,
                logprobs=True, extra_body={"return_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
        status, data = await raw(engine, "POST", "/v1/chat/completions", {
            "messages": messages, "max_completion_tokens": 5, "temperature": 0.7,
            "logprobs": True, "return_token_ids": True,
        })  # fmt: skip
        assert status == 200, data
        return typed, data

    typed, data = run_async(body())
    # OpenAI's own schema; but for `metadata`, whose weight_versions SGLang (0.5.19+) sends as a
    # list of spans where OpenAI types metadata as strings: the engine answers as SGLang does.
    ChatCompletion.model_validate({k: v for k, v in data.items() if k != "metadata"})
    assert data["metadata"]["weight_version"] == "default"
    assert data["metadata"]["weight_versions"][0]["start"] == 0
    assert typed.object == "chat.completion" and typed.model == "tiny" and len(typed.choices) == 2
    prompt = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    assert typed.usage is not None and typed.usage.prompt_tokens == len(prompt)
    assert typed.usage.completion_tokens == 16 and typed.usage.total_tokens == len(prompt) + 16
    for ch in typed.choices:
        extra = ch.model_extra or {}
        ids = extra["response_token_ids"]
        assert extra["prompt_token_ids"] == prompt and len(ids) == 8
        assert ch.finish_reason == "length" and ch.message.role == "assistant"
        assert ch.message.content == TOK.decode(ids, skip_special_tokens=True)
        assert ch.logprobs is not None and ch.logprobs.content is not None
        content = ch.logprobs.content
        assert [t.token for t in content] == [TOK.decode([i]) for i in ids]
        assert all(t.bytes == list(t.token.encode()) for t in content)
        got = [t.logprob for t in content]
        want = recompute_logprobs(engine.model_dir, prompt, ids, 0.7).tolist()
        assert got == pytest.approx(want, abs=1e-4)
    assert data["object"] == "chat.completion" and data["id"]
    assert len(data["choices"][0]["response_token_ids"]) <= 5


def test_completions_shape_ids_and_logprobs(run_async: Any, engine: EngineProcess) -> None:
    prompt = TOK.encode("7+8=")

    async def body() -> Completion:
        async with client(engine) as c:
            return await c.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, logprobs=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )  # fmt: skip

    res = run_async(body())
    Completion.model_validate(res.model_dump(exclude={"metadata"}))
    assert res.object == "text_completion" and len(res.choices) == 1
    ch = res.choices[0]
    ids = (ch.model_extra or {})["token_ids"]
    assert (ch.model_extra or {})["prompt_token_ids"] == prompt and len(ids) == 6
    assert ch.text == TOK.decode(ids, skip_special_tokens=True)
    assert ch.logprobs is not None and ch.logprobs.tokens == [TOK.decode([i]) for i in ids]
    assert ch.logprobs.text_offset == list(range(6))  # one character per token
    want = recompute_logprobs(engine.model_dir, prompt, ids, 1.0).tolist()
    assert ch.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)


def test_what_the_engine_cannot_honour_is_a_400_naming_it(
    run_async: Any, engine: EngineProcess
) -> None:
    async def body() -> list[tuple[int, Any]]:
        msgs = [{"role": "user", "content": "1+1="}]
        chat = "/v1/chat/completions"
        return [
            await raw(engine, "POST", chat, {"messages": msgs, "stream": True}),
            await raw(engine, "POST", chat, {"messages": msgs, "top_logprobs": 2}),
            await raw(engine, "POST", chat, {"messages": []}),
            await raw(engine, "POST", "/v1/completions", {"prompt": {"a": 1}}),
            await raw(engine, "POST", "/v1/completions", {"prompt": "1+1=", "max_tokens": -1}),
            await raw(engine, "GET", "/v1/models"),
        ]

    out = run_async(body())
    for (status, data), word in zip(
        out[:5], ["stream", "top_logprobs", "messages", "prompt", "max_tokens"], strict=True
    ):
        assert status == 400 and word in data["error"]["message"], data
    status, models = out[5]
    assert status == 200 and models["data"][0]["object"] == "model"

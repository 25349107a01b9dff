"""A classic (legacy) `verifiers` environment's own rollout against the CPU engine's
/v1/chat/completions (extra: verifiers; skipped without it): verifiers 0.2.1's API,
`verifiers.legacy` in 0.3 (aliased at the top level). v1 envs run through Flywheel's
own client instead (test_verifiers_v1_rollout.py).

The classic client validates each answer as OpenAI's ChatCompletion, whose
`metadata` is {str: str}; SGLang (0.5.19+) and so this engine send
`metadata.weight_versions` as a list of spans, and the rollout fails. A
transport that drops that one field lets it run; the token ids and logprobs
a trainer needs are in the answers, under SGLang's names, which verifiers'
own token parsing (vLLM's `token_ids`) does not read.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from tests.harness.engines import EngineProcess
from tests.harness.extras import require_verifiers

vf = require_verifiers()

SAMPLING = {"max_tokens": 6, "logprobs": True, "extra_body": {"return_token_ids": True}}


class _DropSpans(httpx.AsyncBaseTransport):
    """Drops metadata.weight_versions from answers; keeps every answer it passes on."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.answers: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        r = await self.inner.handle_async_request(request)
        body = json.loads(await r.aread())
        if isinstance(body.get("metadata"), dict):
            body["metadata"].pop("weight_versions", None)
        self.answers.append(body)
        return httpx.Response(r.status_code, json=body)


def _client(engine: EngineProcess, transport: httpx.AsyncBaseTransport | None = None) -> Any:
    http = httpx.AsyncClient(transport=transport) if transport else None
    oc = openai.AsyncOpenAI(
        base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, http_client=http
    )
    return vf.OpenAIChatCompletionsClient(oc)


def test_a_single_turn_rollout_runs_against_the_engine(run_async: Any, engine: EngineProcess):
    from tests.unit.tasks.verifiers_env_fixture import load_environment

    env = load_environment(n=2)
    row = env.get_dataset()[1]
    plain = run_async(env.run_rollout(row, _client(engine), "tiny", SAMPLING))
    assert "weight_versions" in plain["error"]["error_chain_repr"]  # as against SGLang

    spans = _DropSpans()
    out = run_async(env.run_rollout(row, _client(engine, spans), "tiny", SAMPLING))
    assert out["error"] is None and out["completion"][0]["role"] == "assistant"
    assert set(out["metrics"]) >= {"correct_answer", "short"}
    (answer,) = spans.answers
    choice = answer["choices"][0]
    assert choice["message"]["content"] == out["completion"][0]["content"]
    assert len(choice["response_token_ids"]) == len(choice["logprobs"]["content"]) == 6
    assert choice["prompt_token_ids"] and answer["metadata"]["weight_version"] == "default"


def test_a_tool_env_offers_tools_the_engine_refuses(run_async: Any, engine: EngineProcess):
    from tests.unit.tasks.verifiers_env_fixture import load_tool_environment

    env = load_tool_environment()
    row = env.get_dataset()[0]
    out = run_async(env.run_rollout(row, _client(engine, _DropSpans()), "tiny", SAMPLING))
    assert "tools is not supported by this engine" in out["error"]["error_chain_repr"]

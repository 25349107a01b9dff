"""Prompt logprobs (a teacher's scores): the CPU engine answers `/generate` with
`max_new_tokens` 0 and `logprob_start_len` as SGLang does, and its numbers are a
transformers forward's, within 1e-4 (a real engine subprocess, the tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import torch

from services.engine_api.engine_client import EngineClient
from services.models.tiny_model import build_tokenizer
from tests.harness.engines import EngineProcess

TOK = build_tokenizer()


def forward_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i in 1..L-1 [L - 1], from one transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)  # [L - 1, V]
    return logp.gather(-1, x[0, 1:, None])[:, 0]


async def raw(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=body) as r:
        return r.status, await r.json()


def test_prompt_logprobs_equal_a_transformers_forward(
    run_async: Any, engine: EngineProcess
) -> None:
    ids = TOK.encode("12+34=46 and a longer tail: 99+1=100")
    expected = forward_logprobs(engine.model_dir, ids)

    async def body() -> tuple[list[float], list[float], Any]:
        async with EngineClient(engine.url) as c:
            whole = await c.prompt_logprobs(ids, 0)
            tail = await c.prompt_logprobs(ids, 5)
        return whole, tail, await raw(engine.url, prefill(ids, 5))

    whole, tail, (status, answer) = run_async(body())
    assert torch.allclose(torch.tensor(whole), expected, atol=1e-4, rtol=0)
    assert torch.allclose(torch.tensor(tail), expected[5:], atol=1e-4, rtol=0)
    # SGLang's shape: [logprob, token, null] for input_ids[5:], the first logprob null,
    # nothing generated, finished by length 0.
    assert status == 200
    meta = answer["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == ids[5:]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(t[2] is None for t in meta["input_token_logprobs"])
    assert answer["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(ids)


def prefill(ids: list[int], start: int | None, max_new: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        "return_logprob": True,
    }
    if start is not None:
        body["logprob_start_len"] = start
    return body


def test_logprob_start_len_edges_as_sglang_0_5_23(run_async: Any, engine: EngineProcess) -> None:
    ids = TOK.encode("5+5=10")
    n = len(ids)

    async def body() -> list[tuple[int, Any]]:
        return [
            await raw(engine.url, prefill(ids, None)),  # -1: none from 0.5.10
            await raw(engine.url, prefill(ids, n)),  # = len: accepted, none
            await raw(engine.url, prefill(ids, n + 1)),  # beyond: the scheduler's 400
            await raw(engine.url, prefill(ids, n - 1)),  # the last token alone: [null]
            await raw(engine.url, prefill(ids, 0, max_new=3)),  # with a generation
            await raw(engine.url, {**prefill(ids, 0), "return_logprob": False}),
        ]

    default, at_len, beyond, last, generating, unasked = run_async(body())
    assert default[1]["meta_info"]["input_token_logprobs"] == []
    assert at_len[1]["meta_info"]["input_token_logprobs"] == []
    assert beyond[0] == 400
    assert beyond[1]["error"]["message"] == (
        f"req.logprob_start_len={n + 1} is higher than the number of input tokens "
        f"len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len."
    )
    assert last[1]["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
    meta = generating[1]["meta_info"]
    assert len(meta["input_token_logprobs"]) == n and len(meta["output_token_logprobs"]) == 3
    assert meta["output_token_logprobs_length"] == 3
    assert "input_token_logprobs" not in unasked[1]["meta_info"]

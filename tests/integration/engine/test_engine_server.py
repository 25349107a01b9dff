"""Every endpoint of the CPU engine, against a real server subprocess and a real model."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from services.engine_api.engine_client import EngineClient, EngineHTTPError, GenerateResult
from services.models.tiny_model import TinyModelSpec, build_tokenizer, write_tiny_model
from services.weights import write_weights_dir
from tests.harness.engines import EngineProcess

# The `engine` fixture (tests/integration/engine/conftest.py): .url, .model_dir, .proc.
# `run_async` and `eventually` come from tests/conftest.py.

TOK = build_tokenizer()
LONG = {"max_new_tokens": 200, "ignore_eos": True}


def recompute_logprobs(
    model_dir: Path, prompt: list[int], output: list[int], temperature: float
) -> torch.Tensor:
    """The trainer's view: one full forward of prompt + response, log_softmax(logits / T)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])  # [1, P + R]
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [P + R, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]  # [R, V]
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


async def raw(engine: EngineProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, engine.url + path, json=body) as r:
        ctype = r.content_type
        return r.status, (await r.json()) if ctype == "application/json" else await r.text()


async def wait_running(c: EngineClient, n: int = 1, timeout_s: float = 20.0) -> None:
    """Poll /v1/loads until `n` sequences are decoding (each has at least one token)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await c.loads()).running < n:
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"fewer than {n} requests running after {timeout_s}s")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def slowed(c: EngineClient, seconds: float = 0.01) -> AsyncIterator[None]:
    """Slow decoding (SGLang's /slow_down) so a request is reliably mid-flight; always undone."""
    await c.request("POST", "/slow_down", {"forward_sleep_time": seconds})
    try:
        yield
    finally:
        await c.request("POST", "/slow_down", {"forward_sleep_time": None})
        await c.continue_generation()


def test_generate_shapes_text_ids_batch_and_n(run_async: Any, engine: EngineProcess) -> None:
    async def body() -> None:
        prompt = TOK.encode("12+34=")
        status, single = await raw(
            engine,
            "POST",
            "/generate",
            {
                "text": "12+34=",
                "rid": "r-single",
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
            },
        )
        assert status == 200 and isinstance(single, dict)
        meta = single["meta_info"]
        assert meta["id"] == "r-single" and meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == 5 == len(single["output_ids"])
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == single["output_ids"]
        assert all(lp <= 0 and text is None for lp, _, text in lps)
        assert single["text"] == TOK.decode(single["output_ids"])

        # input_ids give the same greedy output as the same text.
        _, by_ids = await raw(
            engine,
            "POST",
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
            },
        )
        assert by_ids["output_ids"] == single["output_ids"]

        # A batch with n=2 answers prompt-major: 2 prompts x 2 samples, each
        # sample under its own random id (SGLang's regenerate_rid per sample).
        _, batch = await raw(
            engine,
            "POST",
            "/generate",
            {
                "input_ids": [prompt, TOK.encode("7+8=")],
                "rid": ["a", "b"],
                "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True},
            },
        )
        assert isinstance(batch, list) and len(batch) == 4
        ids = [d["meta_info"]["id"] for d in batch]
        assert len(set(ids)) == 4 and all(len(i) == 32 and i not in ("a", "b") for i in ids)
        assert [d["meta_info"]["prompt_tokens"] for d in batch] == [6, 6, 4, 4]
        assert "output_token_logprobs" not in batch[0]["meta_info"]

    run_async(body())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_full_forward_recomputation(
    run_async: Any, engine: EngineProcess, temperature: float
) -> None:
    async def body() -> list[tuple[list[int], GenerateResult]]:
        prompts = [TOK.encode(p) for p in ("12+34=", "5+5=", "a longer prompt here: 99+1=")]
        async with EngineClient(engine.url) as c:
            # Concurrent requests with different settings share decode batches.
            params = [
                {"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True},
                {"max_new_tokens": 16, "temperature": temperature, "top_p": 0.8},
                {"max_new_tokens": 30, "temperature": temperature, "top_k": 5, "ignore_eos": True},
            ]
            results = await asyncio.gather(
                *(c.generate(p, sampling_params=sp) for p, sp in zip(prompts, params, strict=True))
            )
        return [(p, r[0]) for p, r in zip(prompts, results, strict=True)]

    for prompt, res in run_async(body()):
        assert len(res.logprobs) == len(res.output_ids) > 0
        expected = recompute_logprobs(engine.model_dir, prompt, res.output_ids, temperature)
        got = torch.tensor(res.logprobs)
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


def test_seed_stop_strings_and_stop_token_ids(run_async: Any, engine: EngineProcess) -> None:
    async def body() -> None:
        async with EngineClient(engine.url) as c:
            base = {"max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 123}
            [a] = await c.generate(text="1+1=", sampling_params=base)
            [b] = await c.generate(text="1+1=", sampling_params=base)
            assert a.output_ids == b.output_ids  # seeded: reproducible

            # Stop token id: the 4th token of the seeded output stops generation there.
            stop_tok = a.output_ids[3]
            first = a.output_ids.index(stop_tok)
            [s] = await c.generate(
                text="1+1=", sampling_params={**base, "stop_token_ids": [stop_tok]}
            )
            assert s.finish_reason == {"type": "stop", "matched": stop_tok}
            assert s.output_ids == a.output_ids[: first + 1]  # the stop token is kept

            # Stop string: text trimmed unless no_stop_trim; ids keep the matched token.
            stop_str = a.text[5:7]
            cut = a.text.find(stop_str)
            [t] = await c.generate(text="1+1=", sampling_params={**base, "stop": [stop_str]})
            assert t.finish_reason == {"type": "stop", "matched": stop_str}
            assert t.text == a.text[:cut]
            [u] = await c.generate(
                text="1+1=", sampling_params={**base, "stop": stop_str, "no_stop_trim": True}
            )
            assert u.text == a.text[: cut + len(stop_str)]

    run_async(body())


@pytest.mark.parametrize(
    "payload, fragment",
    [
        ({}, "exactly one of text or input_ids"),
        ({"text": "a", "input_ids": [3]}, "exactly one of text or input_ids"),
        ({"input_ids": [3, "x"]}, "input_ids"),
        ({"input_ids": [100000]}, "outside the vocabulary"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 10_000}}, "context length"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k must be -1"),
        ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ],
)
def test_bad_generate_input_is_400(
    run_async: Any, engine: EngineProcess, payload: dict[str, Any], fragment: str
) -> None:
    status, body = run_async(raw(engine, "POST", "/generate", payload))
    assert status == 400
    assert fragment in body["error"]["message"]


def test_bad_json_and_bad_admin_bodies_are_400(run_async: Any, engine: EngineProcess) -> None:
    async def body() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(engine.url + "/generate", data=b"{not json") as r:
                assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
        assert (await raw(engine, "POST", "/pause_generation", {"mode": "sideways"}))[0] == 400
        assert (await raw(engine, "POST", "/abort_request", {}))[0] == 400
        assert (await raw(engine, "POST", "/update_weights_from_disk", {}))[0] == 400

    run_async(body())


def test_abort_by_rid_returns_partial_output(run_async: Any, engine: EngineProcess) -> None:
    async def body() -> None:
        async with EngineClient(engine.url) as c, slowed(c):
            task = asyncio.create_task(c.generate(text="9+9=", rid="victim", sampling_params=LONG))
            other = asyncio.create_task(
                c.generate(
                    text="1+2=",
                    rid="bystander",
                    sampling_params={"max_new_tokens": 20, "ignore_eos": True},
                )
            )
            await wait_running(c)
            # Freeze decoding so the abort lands mid-generation deterministically.
            await c.pause_generation("in_place")
            await c.abort_request("victim")
            [res] = await task
            await c.continue_generation()
            [ok] = await other
        assert res.finish_type == "abort" and res.aborted
        assert 0 < len(res.output_ids) < 200 and len(res.logprobs) == len(res.output_ids)
        assert ok.finish_reason == {"type": "length", "length": 20}

    run_async(body())


def test_abort_all(run_async: Any, engine: EngineProcess) -> None:
    async def body() -> None:
        async with EngineClient(engine.url) as c, slowed(c):
            tasks = [
                asyncio.create_task(c.generate(text=f"{i}+1=", sampling_params=LONG))
                for i in range(3)
            ]
            await wait_running(c, 3)
            await c.pause_generation("in_place")
            await c.abort_request(abort_all=True)
            results = [r[0] for r in await asyncio.gather(*tasks)]
            await c.continue_generation()
        assert [r.finish_type for r in results] == ["abort"] * 3

    run_async(body())


def test_pause_abort_mode_holds_new_requests_until_continue(
    run_async: Any, eventually: Any, engine: EngineProcess
) -> None:
    async def body() -> None:
        async with EngineClient(engine.url) as c, slowed(c):
            running = asyncio.create_task(c.generate(text="3+4=", sampling_params=LONG))
            await wait_running(c)
            await c.pause_generation("abort")
            [aborted] = await running
            assert aborted.aborted
            late = asyncio.create_task(
                c.generate(text="3+4=", sampling_params={"max_new_tokens": 4, "ignore_eos": True})
            )

            async def held() -> bool:
                # SGLang holds it before its scheduler: /v1/loads does not count it.
                info = await c.server_info()
                return bool(info["internal_states"][0]["num_held_reqs"] == 1)

            await eventually(held, timeout_s=10)
            assert not late.done() and (await c.loads()).queued == 0
            await c.continue_generation()
            [res] = await late
            assert res.finish_reason == {"type": "length", "length": 4}

    run_async(body())


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_and_in_place_resume_to_the_same_output(
    run_async: Any, engine: EngineProcess, mode: str
) -> None:
    """A seeded request paused mid-way and continued yields exactly the unpaused output."""
    params = {**LONG, "max_new_tokens": 120, "sampling_seed": 7}

    async def body() -> None:
        async with EngineClient(engine.url) as c:
            [reference] = await c.generate(text="8+8=", sampling_params=params)
            async with slowed(c):
                task = asyncio.create_task(c.generate(text="8+8=", sampling_params=params))
                await wait_running(c)
                await c.pause_generation(mode)
                load = await c.loads()
                if mode == "retract":
                    assert (load.running, load.queued) == (0, 1)
                else:
                    assert (load.running, load.queued) == (1, 0)
                assert not task.done()
            [res] = await task  # slowed() undid the slow-down and continued
        assert res.finish_reason == {"type": "length", "length": 120}
        assert res.output_ids == reference.output_ids
        assert torch.allclose(
            torch.tensor(res.logprobs), torch.tensor(reference.logprobs), atol=1e-4
        )

    run_async(body())


def test_info_health_loads_flush(run_async: Any, engine: EngineProcess) -> None:
    async def body() -> None:
        for path in ("/model_info", "/get_model_info"):
            status, info = await raw(engine, "GET", path)
            assert status == 200 and info["is_generation"] is True and "weight_version" in info
        status, server = await raw(engine, "GET", "/server_info")
        assert status == 200 and server["context_length"] == 256 and "api_key" not in server
        assert (await raw(engine, "GET", "/get_server_info"))[0] == 200
        assert (await raw(engine, "GET", "/health"))[0] == 200
        assert (await raw(engine, "GET", "/health_generate"))[0] == 200
        status, loads = await raw(engine, "GET", "/v1/loads")
        assert status == 200 and loads["version"] == "0.5.23" and len(loads["loads"]) == 1
        entry = loads["loads"][0]
        for key in (
            "num_running_reqs",
            "num_waiting_reqs",
            "num_used_tokens",
            "token_usage",
            "gen_throughput",
            "max_running_requests",
            "dp_rank",
            "timestamp",
        ):
            assert key in entry
        assert (await raw(engine, "POST", "/flush_cache"))[0] == 200
        async with EngineClient(engine.url) as c, slowed(c):
            task = asyncio.create_task(c.generate(text="1+", sampling_params=LONG))
            await wait_running(c)
            assert (await raw(engine, "GET", "/flush_cache"))[0] == 400  # busy, like SGLang
            await c.abort_request(abort_all=True)
            assert (await task)[0].aborted

    run_async(body())


def _published_copy(dst: Path, seed: int) -> Path:
    """A differently initialised model written as a weights directory with a manifest."""
    write_weights_dir(dst, lambda tmp: write_tiny_model(tmp, TinyModelSpec(seed=seed)))
    return dst


def test_update_weights_versions_and_refusals(
    run_async: Any, engine: EngineProcess, tmp_path: Path
) -> None:
    new_dir = _published_copy(tmp_path / "v2", seed=1)
    tampered = tmp_path / "tampered"
    shutil.copytree(new_dir, tampered)
    weights = next(tampered.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    prompt = TOK.encode("2+2=")

    async def body() -> tuple[GenerateResult, GenerateResult]:
        async with EngineClient(engine.url) as c:
            old = await c.weight_version()
            # A request running when the update arrives finishes on the old weights first.
            async with slowed(c, 0.003):
                running = asyncio.create_task(c.generate(prompt, sampling_params=LONG))
                await wait_running(c)
                upd = await c.update_weights_from_disk(str(new_dir), 2)
                [before] = await running
            # Finished in full on the old version: the update waited for it.
            assert before.finish_type == "length" and before.weight_version == old
            assert upd.success and "Weight version updated to 2." in upd.message
            assert await c.weight_version() == 2
            [after] = await c.generate(prompt, sampling_params={"max_new_tokens": 12})

            for bad, why in ((tmp_path / "missing", "not a directory"), (tampered, "sha256")):
                with pytest.raises(EngineHTTPError) as exc:
                    await c.update_weights_from_disk(str(bad), 3)
                assert exc.value.status == 400 and why in exc.value.message
            assert await c.weight_version() == 2
            [still] = await c.generate(prompt, sampling_params={"max_new_tokens": 12})
            return after, still

    after, still = run_async(body(), timeout_s=120)
    for res in (after, still):
        assert res.weight_version == 2
        expected = recompute_logprobs(new_dir, prompt, res.output_ids, 1.0)
        assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4, rtol=0)


def test_wait_mode_update_holds_new_requests_until_it_has_flushed(
    run_async: Any, engine: EngineProcess, tmp_path: Path
) -> None:
    """As SGLang's writer lock does: requests that arrive while an unpaused update
    waits for the running one reach the scheduler only after the update has
    answered, flush included. They used to be let in before the flush, which
    then failed the update with SGLang's 400 (`make demo`: 52 of 130 updates)."""
    new_dir = _published_copy(tmp_path / "v-held", seed=2)
    short = {"max_new_tokens": 3, "ignore_eos": True}

    async def internal(c: EngineClient) -> dict[str, Any]:
        return dict((await c.server_info())["internal_states"][0])

    async def body() -> None:
        async with EngineClient(engine.url) as c:
            async with slowed(c, 0.01):
                running = asyncio.create_task(c.generate(text="7+", sampling_params=LONG))
                await wait_running(c)
                upd = asyncio.create_task(c.update_weights_from_disk(str(new_dir), 5))
                deadline = asyncio.get_running_loop().time() + 20
                while not (await internal(c))["update_pending"]:
                    assert asyncio.get_running_loop().time() < deadline, "update never pending"
                    await asyncio.sleep(0.01)
                # Keep requests coming, as rollout workers do, until the update answers.
                late: list[asyncio.Task[list[GenerateResult]]] = []
                while not upd.done():
                    late.append(asyncio.create_task(c.generate(text="1+2=", sampling_params=short)))
                    await asyncio.sleep(0.02)
                    assert not late[0].done() or upd.done(), "a late request ran before the update"
                result = await upd
                [before] = await running
                answers = [r for t in late for r in await t]
            assert result.success, result.message
            assert before.finish_type == "length" and before.weight_version != 5
            assert len(answers) >= 3
            assert {(r.finish_type, r.weight_version) for r in answers} == {("length", 5)}
            state = await internal(c)
            assert (state["num_held_reqs"], state["update_pending"]) == (0, False)

    run_async(body(), timeout_s=120)


def test_update_with_abort_all_requests_aborts_running(
    run_async: Any, engine: EngineProcess
) -> None:
    async def body() -> None:
        async with EngineClient(engine.url) as c, slowed(c):
            running = asyncio.create_task(c.generate(text="5+", sampling_params=LONG))
            await wait_running(c)
            upd = await c.update_weights_from_disk(str(engine.model_dir), 41, update_mode="abort")
            [res] = await running
            assert upd.success and res.aborted
            [later] = await c.generate(text="5+", sampling_params={"max_new_tokens": 2})
            assert later.weight_version == 41

    run_async(body())


def test_a_client_hanging_up_on_a_waiting_update_leaves_the_engine_serving(
    run_async: Any, engine: EngineProcess
) -> None:
    """The update is applied (SGLang's scheduler does not see the client go) and the
    scheduler, whose answer now has nobody to take it, goes on serving. A chaos run
    once lost an engine this way: sync was killed mid-update and the scheduler
    thread died on the cancelled answer, behind an HTTP server that stayed up."""

    async def body() -> None:
        async with EngineClient(engine.url) as c:
            async with slowed(c, 0.003):
                running = asyncio.create_task(c.generate(text="5+", sampling_params=LONG))
                await wait_running(c)
                with pytest.raises(asyncio.TimeoutError):  # waits for the running request
                    async with aiohttp.ClientSession() as s:
                        await s.post(
                            engine.url + "/update_weights_from_disk",
                            json={"model_path": str(engine.model_dir), "weight_version": "42"},
                            timeout=aiohttp.ClientTimeout(total=0.3),
                        )
                [res] = await running
            assert res.finish_type == "length"
            [later] = await c.generate(text="5+", sampling_params={"max_new_tokens": 2})
            assert later.weight_version == 42
            assert (await raw(engine, "GET", "/health"))[0] == 200

    run_async(body(), timeout_s=120)

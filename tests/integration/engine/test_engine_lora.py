"""LoRA on the CPU engine: an adapter served per request equals PEFT's merged model.

A real PEFT adapter (peft==0.21.2, the `lora` extra) on the tiny model, on
every linear layer of its blocks, with B nonzero: the engine serving the
base model with that adapter (`lora_path`) must generate what an engine
serving `merge_and_unload()`'s weights generates, token for token, with the
same logprobs; a batch mixing the base model and two adapters must give each
request its own answer; with `max_loras_per_batch` = 2 the third kind waits
its turn instead of failing. Everything goes through EngineClient, so the
client's LoRA calls are exercised too.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.engine_api.engine_client import EngineClient, EngineHTTPError, GenerateResult
from services.models.tiny_model import TinyModelSpec, write_tiny_model
from tests.harness.engines import EngineStates, serving_engine

pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": TARGETS}
PROMPTS = [[4, 5, 71, 6], [10, 11, 12], [30, 31, 32, 33, 34, 35], [7]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def peft_adapter(model_dir: Path, out: Path, seed: int) -> tuple[Path, Path]:
    """A PEFT LoRA (r 4, alpha 8, B random) saved at out/adapter, and the model with it
    merged in at out/merged (tokenizer files copied from the base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                        init_lora_weights=False)  # fmt: skip
    model = get_peft_model(base, config)
    model.save_pretrained(str(out / "adapter"))
    merged_dir = out / "merged"
    shutil.copytree(model_dir, merged_dir)
    merged: Any = model.merge_and_unload()
    merged.save_pretrained(merged_dir)
    return out / "adapter", merged_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = write_tiny_model(root / "model", TinyModelSpec())
    a1, merged1 = peft_adapter(model, root / "a1", seed=1)
    a2, _ = peft_adapter(model, root / "a2", seed=2)
    return {"model": model, "a1": a1, "a2": a2, "merged1": merged1}


@pytest.fixture(scope="module")
def states(dirs: dict[str, Path]) -> Iterator[dict[str, EngineStates]]:
    made = {"base": EngineStates(dirs["model"]), "merged": EngineStates(dirs["merged1"])}
    yield made
    for s in made.values():
        s.close()


async def greedy(c: EngineClient, lora: str | None) -> list[GenerateResult]:
    return [(await c.generate(p, sampling_params=GREEDY, lora_path=lora))[0] for p in PROMPTS]


def same(a: list[GenerateResult], b: list[GenerateResult], atol: float = 1e-4) -> bool:
    return all(
        x.output_ids == y.output_ids
        and all(abs(p - q) <= atol for p, q in zip(x.logprobs, y.logprobs, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def test_adapter_equals_peft_merged_model(
    dirs: dict[str, Path], states: dict[str, EngineStates], run_async: Any
) -> None:
    lora_state = states["base"].get(**LORA)
    merged_state = states["merged"].get()

    async def body() -> None:
        async with serving_engine(lora_state) as url, EngineClient(url) as c:
            await c.load_lora_adapter("a1", str(dirs["a1"]))
            with_adapter = await greedy(c, "a1")
            base = await greedy(c, None)
            await c.unload_lora_adapter("a1")
        async with serving_engine(merged_state) as url, EngineClient(url) as c:
            merged = await greedy(c, None)
        assert not same(base, merged), "the adapter changes nothing: the test proves nothing"
        assert same(with_adapter, merged), (
            [r.output_ids for r in with_adapter], [r.output_ids for r in merged],
        )  # fmt: skip

    run_async(body(), timeout_s=120)


@pytest.mark.parametrize("per_batch", [8, 2])
def test_a_batch_mixes_adapters(
    per_batch: int, dirs: dict[str, Path], states: dict[str, EngineStates], run_async: Any
) -> None:
    """Base, a1 and a2 requests released together (held by a pause, so they reach the
    scheduler at once) each answer as alone; with 2 per batch the third kind waits."""
    state = states["base"].get(**LORA, max_loras_per_batch=per_batch)
    layers = state.scheduler.runner.lora
    kinds_per_forward: list[int] = []
    set_rows = layers.set_rows

    def recording(lora_ids: list[str | None]) -> None:  # what each forward mixes
        kinds_per_forward.append(len(set(lora_ids)))
        set_rows(lora_ids)

    layers.set_rows = recording

    async def body() -> None:
        async with serving_engine(state) as url, EngineClient(url) as c:
            for name in ("a1", "a2"):
                await c.load_lora_adapter(name, str(dirs[name]))
            alone = {n: await greedy(c, n) for n in (None, "a1", "a2")}
            await c.pause_generation("in_place")
            kinds = [None, "a1", "a2"] * 2
            tasks = [asyncio.create_task(greedy(c, n)) for n in kinds]
            await asyncio.sleep(0.2)
            await c.continue_generation()
            mixed = await asyncio.gather(*tasks)
            for name in ("a1", "a2"):
                await c.unload_lora_adapter(name)
        assert not same(alone["a1"], alone["a2"])
        for kind, got in zip(kinds, mixed, strict=True):
            assert same(got, alone[kind]), kind
        assert max(kinds_per_forward) == min(per_batch, 3), kinds_per_forward

    try:
        run_async(body(), timeout_s=180)
    finally:
        layers.set_rows = set_rows


def test_unload_waits_for_requests_using_the_adapter(
    dirs: dict[str, Path], states: dict[str, EngineStates], run_async: Any
) -> None:
    """SGLang's wait_for_unload: the unload answers only after the adapter's requests did;
    then the name is refused until loaded again (0.5.6+: reloaded from its path)."""
    state = states["base"].get(**LORA, sglang_version="0.5.4")

    async def body() -> None:
        async with serving_engine(state) as url, EngineClient(url) as c:
            await c.load_lora_adapter("a1", str(dirs["a1"]))
            await c.request("POST", "/slow_down", {"forward_sleep_time": 0.05})
            long = {**GREEDY, "max_new_tokens": 30}
            gen = asyncio.create_task(c.generate(PROMPTS[0], sampling_params=long, lora_path="a1"))
            while state.scheduler.load()["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            await c.unload_lora_adapter("a1")
            assert gen.done(), "the unload answered while a request still used the adapter"
            assert (await gen)[0].completion_tokens == 30
            await c.request("POST", "/slow_down", {"forward_sleep_time": None})
            with pytest.raises(EngineHTTPError) as err:
                await c.generate(PROMPTS[0], sampling_params=GREEDY, lora_path="a1")
            assert err.value.status == 400 and "not loaded: a1" in err.value.message

    run_async(body(), timeout_s=120)


def test_a_batch_request_names_an_adapter_per_prompt(
    dirs: dict[str, Path], states: dict[str, EngineStates], run_async: Any
) -> None:
    """`lora_path` as a list: one adapter (or None) per prompt of a batch request."""
    state = states["base"].get(**LORA)

    async def body() -> None:
        async with serving_engine(state) as url, EngineClient(url) as c:
            await c.load_lora_adapter("a1", str(dirs["a1"]))
            alone = [(await greedy(c, n))[0] for n in (None, "a1")]
            out = await c.request("POST", "/generate", {
                "input_ids": [PROMPTS[0], PROMPTS[0]], "sampling_params": GREEDY,
                "return_logprob": True, "lora_path": [None, "a1"]})  # fmt: skip
            with pytest.raises(EngineHTTPError) as err:
                await c.request("POST", "/generate", {
                    "input_ids": [PROMPTS[0], PROMPTS[0]], "sampling_params": GREEDY,
                    "lora_path": ["a1", "nope"]})  # fmt: skip
            await c.unload_lora_adapter("a1")
        assert same([GenerateResult.from_json(d) for d in out], alone)
        assert err.value.status == 400 and "never been loaded: nope" in err.value.message

    run_async(body(), timeout_s=120)

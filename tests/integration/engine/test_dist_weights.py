"""SGLang's distributed weights protocol on a real CPU engine, rank 0 in this process (gloo).

The engine is a subprocess; this process joins its weights-update group as
rank 0 and broadcasts, as a trainer would. The engine must then generate
with exactly the broadcast weights (its logprobs equal a local forward pass
of those weights), and answer bad requests with SGLang's messages.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from services.weights.distgroup import broadcast_tensors, destroy_group, join_group
from tests.harness.engines import EngineProcess
from tests.harness.ports import free_port

PROMPT = [5, 6, 7, 8, 9]


async def post(engine: EngineProcess, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(engine.url + path, json=body) as r:
        return r.status, await r.json()


async def joined(engine: EngineProcess, name: str) -> Any:
    """Form a two-rank group: the engine's HTTP init and this process's join, together."""
    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }
    pg, (status, got) = await asyncio.gather(
        asyncio.to_thread(join_group, "127.0.0.1", port, 0, 2, name, "gloo", 60.0),
        post(engine, "/init_weights_update_group", body),
    )
    assert (status, got["success"]) == (200, True), got
    return pg


def update_body(tensors: dict[str, torch.Tensor], name: str, version: str) -> dict[str, Any]:
    return {
        "names": list(tensors),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": name,
        "weight_version": version,
    }


async def generate(engine: EngineProcess) -> dict[str, Any]:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
    }
    status, out = await post(engine, "/generate", body)
    assert status == 200, out
    return dict(out)


def local_logprobs(model_dir: Path, state: dict[str, torch.Tensor], ids: list[int]) -> list[float]:
    """Each generated token's logprob under `state`, by a plain forward pass here."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    seq = torch.tensor([PROMPT + ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float(), -1)  # [T, V]
    start = len(PROMPT) - 1
    return [float(logp[start + i, tok]) for i, tok in enumerate(ids)]


def test_broadcast_weights_are_served(run_async: Any, engine: EngineProcess) -> None:
    run_async(broadcast_weights_are_served(engine))


async def broadcast_weights_are_served(engine: EngineProcess) -> None:
    from transformers import AutoModelForCausalLM

    before = await generate(engine)
    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    pg = await joined(engine, "wg")
    assert (await post(engine, "/begin_weight_update"))[0] == 200
    (status, got), _ = await asyncio.gather(
        post(engine, "/update_weights_from_distributed", update_body(new, "wg", "v7")),
        asyncio.to_thread(broadcast_tensors, pg, list(new.values())),
    )
    assert (await post(engine, "/end_weight_update"))[0] == 200
    assert status == 200, got
    assert got == {
        "success": True,
        "message": "Succeeded to update parameter online. Weight version updated to v7.",
    }
    after = await generate(engine)
    assert after["meta_info"]["weight_version"] == "v7"
    triples = after["meta_info"]["output_token_logprobs"]
    ids = [t[1] for t in triples]
    assert [t[0] for t in triples] == pytest.approx(
        local_logprobs(engine.model_dir, new, ids), abs=1e-4
    )
    assert triples != before["meta_info"]["output_token_logprobs"]
    # a broadcast whose shape the model does not have: received, then refused as SGLang does
    name = next(iter(new))
    assert (await post(engine, "/begin_weight_update"))[0] == 200
    (status, got), _ = await asyncio.gather(
        post(
            engine,
            "/update_weights_from_distributed",
            update_body({name: torch.zeros(3)}, "wg", "v8"),
        ),
        asyncio.to_thread(broadcast_tensors, pg, [torch.zeros(3)]),
    )
    await post(engine, "/end_weight_update")
    assert status == 400 and got["success"] is False
    assert got["message"].startswith("Failed to update parameter online: Attempted to load weight")
    assert (await post(engine, "/destroy_weights_update_group", {"group_name": "wg"}))[1] == {
        "success": True,
        "message": "Succeeded to destroy custom process group.",
    }
    destroy_group(pg)


def test_refusals_answer_like_sglang(run_async: Any, engine: EngineProcess) -> None:
    run_async(refusals_answer_like_sglang(engine))


async def refusals_answer_like_sglang(engine: EngineProcess) -> None:
    body = update_body({"x": torch.zeros(2)}, "nope", "v9")
    status, got = await post(engine, "/update_weights_from_distributed", body)
    assert (status, got["success"]) == (400, False)
    assert got["message"] == (
        "update_weights_from_distributed must run between "
        "begin_weight_update() and end_weight_update()"
    )
    assert (await post(engine, "/begin_weight_update"))[0] == 200
    assert (await post(engine, "/begin_weight_update"))[0] == 400  # one session at a time
    status, got = await post(engine, "/update_weights_from_distributed", body)
    assert (await post(engine, "/end_weight_update"))[0] == 200
    assert status == 400
    assert got["message"].startswith("Failed to receive weights: Group nope not in [")
    status, got = await post(engine, "/destroy_weights_update_group", {"group_name": "nope"})
    assert (status, got) == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )
    assert (await post(engine, "/end_weight_update"))[0] == 400

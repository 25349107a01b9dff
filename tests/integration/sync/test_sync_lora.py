"""Sync with LoRA versions against a real CPU engine started with enable_lora.

The trainer (LoRA, on a tiny model) writes four adapter versions; sync
loads each as the named adapter `v00000N` (`[sync] lora_mode = "adapter"`),
counts it served at once and unloads all but the `lora_keep` newest, while
a request with the oldest adapter is still running (its unload waits for
it); a restarted sync reads what is loaded from the engine. A version
generated with the adapter equals the same version merged into its base
and loaded whole (`lora_mode = "merged"`, for engines without adapters);
merged copies older than the one before are deleted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proto.weight_version import adapter_name
from services.engine_api.engine_client import EngineClient
from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.sync.app import SyncService
from services.sync.core import Engine, Published
from services.sync.settings import SyncSettings
from services.weights import SharedDir
from services.weights.adapter_load import AdapterLoad, MergedLoad, adapter_versions, superseded
from tests.harness.engines import EngineStates, serving_engine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("synclora") / "model", TinyModelSpec())


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Versions 1..4 of a LoRA run on the tiny model (large steps: the outputs move)."""
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.trainer import Trainer
    from services.weights.adapter import LoraSettings
    from tests.integration.trainer.trainer_helpers import random_batch

    cfg = TrainConfig(
        optim=OptimConfig(lr=5e-2, warmup_steps=0, schedule="constant"),
        model=ModelConfig(micro_batch_tokens=100_000),
        lora=LoraSettings(rank=4, alpha=16),
    )
    t = Trainer.from_pretrained(model_dir, cfg)
    root = tmp_path_factory.mktemp("synclora") / "weights"
    out = {}
    for v in (1, 2, 3, 4):
        t.train_step(random_batch(seed=v))
        out[v] = root / adapter_name(v)
        t.save_weights(out[v])
    return out


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[EngineStates]:
    states = EngineStates(model_dir)
    yield states
    states.close()


class Ctx:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.js = None
        self.max_payload = 1024 * 1024


def test_superseded_keeps_the_newest() -> None:
    assert superseded({1, 2, 3}, 3, 2) == [1]
    assert superseded({1, 2, 3}, 3, 1) == [1, 2]
    assert superseded({3}, 3, 2) == []
    assert adapter_versions(
        {"data": [{"id": "base", "parent": None}, {"id": "v000002", "parent": "base"},
                  {"id": "mine", "parent": "base"}]}
    ) == {2}  # fmt: skip


def test_sync_loads_each_version_as_an_adapter_and_unloads_superseded_ones(
    engines: EngineStates, adapters: dict[int, Path], run_async: Any
) -> None:
    state = engines.get(
        enable_lora=True, max_lora_rank=8, lora_target_modules=TARGETS, max_loras_per_batch=4
    )

    async def body() -> None:
        async with serving_engine(state) as url, EngineClient(url) as c:
            svc = SyncService(Ctx(), SyncSettings(lora_keep=2, update_timeout_s=30))  # type: ignore[arg-type]
            e = Engine("engine-0", url, 0, time.time())
            svc.reg.engines[e.engine_id] = e
            base = await c.generate([4, 5, 6], sampling_params=GREEDY)

            async def to(v: int) -> None:
                p = Published(v, AdapterLoad(SharedDir(str(adapters[v]))), time.time(), True)
                svc.reg.publish(p)
                await svc.update(e, p)
                assert e.version == v and not e.updating

            await to(1)
            [v1] = await c.generate([4, 5, 6], sampling_params=GREEDY, lora_path="v000001")
            # the adapter changes the distribution sampled from
            assert (
                max(abs(a - b) for a, b in zip(v1.logprobs, base[0].logprobs, strict=True)) > 0.05
            )
            await to(2)
            # a long request with v1 runs while v3 arrives: v1's unload waits for it
            # 0.2 s a token: the 30-token flight outlasts v3's load under make test's load
            await c.request("POST", "/slow_down", {"forward_sleep_time": 0.2})
            long = {**GREEDY, "max_new_tokens": 30}
            flight = asyncio.create_task(
                c.generate([4, 5, 6], sampling_params=long, lora_path="v000001")
            )
            while state.scheduler.generated_tokens < 2:
                await asyncio.sleep(0.02)
            update = asyncio.create_task(to(3))
            deadline = time.monotonic() + 5.0  # a fixed 0.5 s wait was too short under load
            while e.version != 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert e.version == 3  # served while v1's request runs; the unload is waiting
            assert not flight.done() and not update.done()
            await c.request("POST", "/slow_down", {"forward_sleep_time": None})
            [done] = await flight
            await update
            assert len(done.output_ids) == 30 and not done.aborted
            assert e.adapters == {2, 3}
            assert adapter_versions(await c.request("GET", "/v1/models")) == {2, 3}
            # a retried load of a version the engine has already is a success
            await svc.update(e, Published(3, AdapterLoad(SharedDir(str(adapters[3]))), 0, True))
            assert e.failures == 0
            # a restarted sync knows nothing it loaded: it reads the engine's adapters
            # (/v1/models) at its first load there and unloads the superseded ones
            again = SyncService(Ctx(), SyncSettings(lora_keep=2, update_timeout_s=30))  # type: ignore[arg-type]
            e = Engine("engine-0", url, 3, time.time())
            again.reg.engines[e.engine_id] = e
            await again.update(e, Published(4, AdapterLoad(SharedDir(str(adapters[4]))), 0, True))
            assert adapter_versions(await c.request("GET", "/v1/models")) == {3, 4}

    run_async(body(), timeout_s=180)


def test_merged_mode_serves_what_the_adapter_serves(
    engines: EngineStates, adapters: dict[int, Path], run_async: Any
) -> None:
    with_lora = engines.get(
        enable_lora=True, max_lora_rank=8, lora_target_modules=TARGETS, max_loras_per_batch=4
    )
    plain = engines.get()

    async def body() -> None:
        async with serving_engine(with_lora) as url, EngineClient(url) as c:
            await c.load_lora_adapter("direct-v3", str(adapters[3]))
            [want] = await c.generate([4, 5, 6], sampling_params=GREEDY, lora_path="direct-v3")
        async with serving_engine(plain) as url, EngineClient(url) as c:
            svc = SyncService(Ctx(), SyncSettings(lora_mode="merged"))  # type: ignore[arg-type]
            e = Engine("engine-1", url, 0, time.time())
            svc.reg.engines[e.engine_id] = e
            for v in (1, 3):
                await svc.update(e, Published(v, MergedLoad(SharedDir(str(adapters[v]))), 0))
                assert e.version == v and e.failures == 0
            assert await c.weight_version() == 3
            [got] = await c.generate([4, 5, 6], sampling_params=GREEDY)
        assert got.output_ids == want.output_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-3)
        assert (adapters[3].parent / "v000003-merged" / "model.safetensors").is_file()
        assert not (adapters[1].parent / "v000001-merged").exists()  # a whole model each

    run_async(body(), timeout_s=180)

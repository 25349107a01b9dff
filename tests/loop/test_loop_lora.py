"""The closed loop with LoRA: the trainer publishes adapters, engines serve them by name.

One small stack (two CPU engines started with enable_lora and their
workers with `[rollout] lora`, sync in `lora_mode = "adapter"`, the
trainer with `[trainer.lora]`, buffer; a third engine planned and started
late), weights over NATS. Each version is PEFT's adapter directory, a
fraction of the model; sync loads it on every engine as the adapter
`v00000N` beside the base, which no engine ever reloads (its own
weight_version stays 0), and unloads superseded ones; every sample records
the adapter version it was generated with, within the staleness bound.
A late engine starts from the base model once and gets only the newest
adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proto.messages import SampleGroup, TrainBatch
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from services.weights.adapter_load import adapter_versions
from tests.harness.poll import wait_for
from tests.harness.probe import http_json
from tests.harness.stack import Stack, start_loop
from tests.harness.streams import messages, published_versions
from tests.loop.test_loop import STALENESS, loop_config

RUN = "looplora"
S = Subjects(RUN)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("looplora")
    config = root / "run.toml"
    text = loop_config(
        RUN, root, tiny_model, engines=3, weights_transport="nats",
        lora={"rank": 4, "alpha": 16},
    )  # fmt: skip
    # the engines serve adapters, the workers name them, sync loads them by name
    text = text.replace(
        "[engine]\nnum_threads = 1",
        "[engine]\nnum_threads = 1\nenable_lora = true\nmax_lora_rank = 8\n"
        f"lora_target_modules = {TARGETS!r}\nmax_loras_per_batch = 4".replace("'", '"'),
    )
    text = text.replace("[rollout]\n", "[rollout]\nlora = true\n")
    text = text.replace("[sync]\n", '[sync]\nlora_mode = "adapter"\nlora_keep = 2\n')
    config.write_text(text)
    assert "enable_lora = true" in text and "[trainer.lora]" in text, text
    no_weights = {"FLYWHEEL_SYNC_WEIGHTS_ROOT": str(root / "sync-has-no-weights")}
    with (
        NatsServer(store_dir=root / "nats") as nats,
        Stack(config, nats.url, env=no_weights) as st,
    ):
        start_loop(st)
        yield st


def adapters(st: Stack, i: int) -> set[int]:
    """The adapter versions engine i has loaded (its /v1/models)."""
    return adapter_versions(http_json(f"{st.proc(f'engine-{i}').url}/v1/models", timeout_s=2.0))


def test_engines_follow_adapter_versions_and_samples_record_them(
    stack: Stack, tiny_model: Path
) -> None:
    st = stack
    for v in (1, 2, 3):
        wait_for(lambda v=v: st.trained_steps() >= v, 90, f"trainer step {v}")
        wait_for(lambda v=v: all(max(adapters(st, i), default=0) >= v for i in (0, 1)), 30,
                 f"both engines with adapter v{v}")  # fmt: skip
    for i in (0, 1):
        # lora_keep: superseded adapters are unloaded, once no request uses them (SGLang's
        # rule), so a third can stay loaded a moment while the steps go on (make test's load).
        wait_for(lambda i=i: len(adapters(st, i)) <= 2, 30, f"engine-{i} at <= 2 adapters")
        assert st.engine_version(i) == 0  # the base, loaded once, never replaced
    pubs = published_versions(st.nats_url, RUN)
    model_bytes = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors"))
    for p in pubs.values():
        assert p.format == "peft-lora" and p.uri.startswith("nats://"), p
        assert p.size_bytes < 0.25 * model_bytes, (p.size_bytes, model_bytes)
    # every sample says which adapter made it, within the staleness bound
    trained = messages(st.nats_url, RUN, "BATCHES", S.batches, TrainBatch)
    assert any(smp.weight_version >= 1 for b in trained for g in b.groups for smp in g.samples)
    for b in trained:
        for g in b.groups:
            for smp in g.samples:
                assert smp.weight_version >= b.step - STALENESS, (b.batch_id, smp.sample_id)
                assert smp.weight_version == smp.weight_version_last  # one adapter throughout
    for i in (0, 1):
        v = st["sync"].metric("flywheel_sync_engine_version", f'engine="engine-{i}"')
        assert v is not None and v >= 3


def test_a_late_engine_loads_the_base_once_and_the_newest_adapter(stack: Stack) -> None:
    st = stack
    wait_for(lambda: max(published_versions(st.nats_url, RUN), default=0) >= 5, 150, "v5")
    newest_at_start = max(published_versions(st.nats_url, RUN))
    st.start("engine-2", "rollout-2")  # together: the worker waits for its engine

    def late_groups() -> list[SampleGroup]:
        groups = messages(st.nats_url, RUN, "SAMPLES", S.samples, SampleGroup)
        return [g for g in groups if g.worker_id == "rollout-2"]

    wait_for(late_groups, 120, "a group from the late engine")
    assert st.engine_version(2) == 0  # it runs the base it started with
    assert min(adapters(st, 2)) >= newest_at_start  # never an older adapter
    for g in late_groups():
        assert all(s.weight_version >= newest_at_start for s in g.samples), g.group_id
    downloads = st["rollout-2"].metric("flywheel_rollout_weights_downloaded_version")
    assert downloads is not None and downloads >= newest_at_start

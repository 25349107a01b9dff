"""The closed loop with weights over torch.distributed (`weights_transport = "distributed"`).

As test_loop_delta.py: two CPU engines with their workers, sync, trainer,
buffer; a third engine started late. Sync is rank 0 of one gloo group per
engine (services/weights/distributed.py) and broadcasts every
version into it through SGLang's `/update_weights_from_distributed`; the
late engine gets its own group at its first update and serves the newest
version without the others being touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proto.messages import SampleGroup
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.stack import Stack, start_loop
from tests.harness.streams import messages, published_versions
from tests.loop.test_loop import loop_config

RUN = "loopdist"
S = Subjects(RUN)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("loopdist")
    config = root / "run.toml"
    config.write_text(
        loop_config(RUN, root, tiny_model, engines=3, weights_transport="distributed")
    )
    with NatsServer(store_dir=root / "nats") as nats, Stack(config, nats.url) as st:
        start_loop(st)
        yield st


def test_engines_follow_every_version_over_gloo(stack: Stack, tiny_model: Path) -> None:
    st = stack
    wait_for(
        lambda: all((st.engine_version(i) or 0) >= 4 for i in (0, 1)), 150, "both engines at v4"
    )
    assert all(p.uri.startswith("dist://") for p in published_versions(st.nats_url, RUN).values())
    for i in (0, 1):  # never loaded from disk: the model directory is still the first one
        assert Path((st.engine_info(i) or {})["model_path"]) == tiny_model


def test_a_late_engine_gets_its_own_group(stack: Stack) -> None:
    st = stack
    wait_for(lambda: max(published_versions(st.nats_url, RUN), default=0) >= 5, 150, "v5 published")
    st.start("engine-2", "rollout-2")  # together: the worker waits for its engine

    def first_group() -> SampleGroup | None:
        groups = messages(st.nats_url, RUN, "SAMPLES", S.samples, SampleGroup)
        return next((g for g in groups if g.worker_id == "rollout-2"), None)

    wait_for(first_group, 120, "a group from the late engine")
    assert (st.engine_version(2) or 0) >= 5

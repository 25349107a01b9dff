"""The closed loop with weights as sparse deltas over NATS (`weights_transport = "nats-delta"`).

One small stack (two CPU engines with their workers, sync, trainer,
buffer; a third engine planned and started late), as test_loop.py but with
the delta transport and a full snapshot every 3 versions. The engines
follow every version from deltas rebuilt beside them, each copy the
trainer's exact bytes (sha256 of its manifest = the announced digest); an
engine that joins late catches up from the last snapshot plus the deltas
after it, and serves the newest version; `flywheel status` and the
trainer's metrics say what each version cost on the wire.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proto.messages import SampleGroup
from proto.subjects import Subjects
from proto.weight_version import parse_name
from services.stack.localdev.nats_server import NatsServer
from services.weights import read_manifest
from tests.harness.poll import wait_for
from tests.harness.stack import Stack, start_loop
from tests.harness.streams import messages, published_versions
from tests.loop.test_loop import loop_config

RUN = "loopdelta"
S = Subjects(RUN)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("loopdelta")
    config = root / "run.toml"
    config.write_text(
        loop_config(
            RUN,
            root,
            tiny_model,
            engines=3,
            weights_transport="nats-delta",
            weights_snapshot_every=3,
        )
    )
    no_weights = {"FLYWHEEL_SYNC_WEIGHTS_ROOT": str(root / "sync-has-no-weights")}
    with (
        NatsServer(store_dir=root / "nats") as nats,
        Stack(config, nats.url, env=no_weights) as st,
    ):
        start_loop(st)
        yield st


def engine_copy_is_exact(st: Stack, i: int) -> int:
    """The version engine i serves, after checking its local copy is the trainer's bytes."""
    path = Path((st.engine_info(i) or {})["model_path"])
    assert path.is_relative_to((st.root / f"engine-weights-{i}").resolve()), path
    version = parse_name(path.name)
    assert version is not None, path
    assert read_manifest(path).sha256 == published_versions(st.nats_url, RUN)[version].sha256
    return version


def test_engines_follow_every_version_from_deltas_exactly(stack: Stack) -> None:
    st = stack
    wait_for(
        lambda: all((st.engine_version(i) or 0) >= 5 for i in (0, 1)), 150, "both engines at v5"
    )
    pubs = published_versions(st.nats_url, RUN)
    assert all(p.uri.startswith("natsdelta://") for p in pubs.values()), pubs
    for i in (0, 1):
        assert engine_copy_is_exact(st, i) >= 5
        deltas = st[f"rollout-{i}"].metric("flywheel_rollout_weights_deltas_applied_total")
        assert deltas is not None and deltas >= 2, deltas
    # every version after the first carries its delta's cost; a delta is far below the whole
    later = [p for v, p in sorted(pubs.items()) if v >= 2]
    assert later
    for p in later:
        assert p.wire is not None and p.wire.delta_bytes is not None, p
        assert p.wire.delta_bytes < p.size_bytes, p
    assert (st["trainer"].metric("flywheel_trainer_weights_delta_bytes") or 0) > 0


def test_a_late_engine_catches_up_from_the_snapshot_and_deltas(stack: Stack) -> None:
    st = stack
    wait_for(lambda: max(published_versions(st.nats_url, RUN), default=0) >= 7, 150, "v7 published")
    st.start("engine-2", "rollout-2")  # together: the worker waits for its engine

    def first_group() -> SampleGroup | None:
        groups = messages(st.nats_url, RUN, "SAMPLES", S.samples, SampleGroup)
        return next((g for g in groups if g.worker_id == "rollout-2"), None)

    wait_for(first_group, 120, "a group from the late engine")
    assert engine_copy_is_exact(st, 2) >= 7
    # from then on it follows from deltas too (its first copy: the snapshot plus deltas,
    # or the snapshot itself when the newest version was one)
    wait_for(
        lambda: (st["rollout-2"].metric("flywheel_rollout_weights_deltas_applied_total") or 0) >= 1,
        90,
        "the late engine applying deltas",
    )
    assert engine_copy_is_exact(st, 2) >= 8

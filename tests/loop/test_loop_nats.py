"""The closed loop with weights over NATS: no directory is shared with the engines.

The trainer sends each version as chunks into JetStream; each rollout
worker downloads it into its own engine-local directory; sync points each
engine at its own copy; the run keeps stepping; old versions' chunks are
purged from the stream.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.messages import WeightsPublished
from proto.streams import stream_name
from proto.subjects import Subjects
from services.common.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.stack import Stack, printing_logs_on_failure
from tests.harness.streams import messages
from tests.loop.test_loop import loop_config

RUN = "loopnats"
S = Subjects(RUN)


def chunk_versions(nats_url: str) -> set[int]:
    import asyncio

    import nats

    async def body() -> set[int]:
        nc = await nats.connect(nats_url)
        try:
            info = await nc.jetstream().stream_info(
                stream_name(RUN, "WEIGHTDATA"), subjects_filter=S.weightdata_all
            )
            return {int(s.rsplit(".v", 1)[1]) for s in (info.state.subjects or {})}
        finally:
            await nc.close()

    return asyncio.run(body())


@pytest.mark.slow
def test_weights_over_nats_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(loop_config(RUN, tmp_path, tiny_model, weights_transport="nats"))
    assert 'weights_transport = "nats"' in config.read_text()
    # sync gets a weights root of its own: it must not need the trainer's files
    # (the variable is only sync's; the harness gives it to every process)
    no_weights = {"FLYWHEEL_SYNC_WEIGHTS_ROOT": str(tmp_path / "sync-has-no-weights")}
    with (
        NatsServer(store_dir=tmp_path / "nats") as nats,
        Stack(config, nats.url, env=no_weights) as st,
        printing_logs_on_failure(st),
    ):
        st.start("engine-0", "engine-1")
        st.start("rollout-0", "rollout-1", "sync", "trainer")
        st.start("buffer")
        wait_for(lambda: st.trained_steps() >= 4, 120, "four trainer steps")
        wait_for(lambda: all((st.engine_version(i) or 0) >= 4 for i in (0, 1)), 30,
                 "both engines at v4")  # fmt: skip
        pubs = messages(st.nats_url, RUN, "WEIGHTS", S.weights_published, WeightsPublished)
        assert pubs and all(p.uri.startswith("nats://") for p in pubs), pubs
        for i in (0, 1):
            # each engine loaded its own verified copy, not the trainer's directory
            local = (st.root / f"engine-weights-{i}").resolve()
            path = Path((st.engine_info(i) or {})["model_path"])
            assert path.is_relative_to(local), path
            got = st[f"rollout-{i}"].metric("flywheel_rollout_weights_downloaded_version")
            assert got is not None and got >= 4
        # keep_last = 2: the chunks of old versions leave the stream
        wait_for(lambda: 1 not in chunk_versions(st.nats_url), 30, "v1 chunks purged")
        assert chunk_versions(st.nats_url), "the newest versions' chunks are kept"

"""The closed loop with weights over NATS: no directory is shared with the engines.

The trainer sends each version as chunks into JetStream; each rollout
worker downloads it into its own engine-local directory; sync points each
engine at its own copy; the run keeps stepping; old versions' chunks are
purged from the stream.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from loop_stack import LoopStack, messages, wait_for
from test_loop import loop_config

from proto.messages import WeightsPublished
from proto.streams import stream_name
from proto.subjects import Subjects
from services.common.nats_server import NatsServer

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


def test_weights_over_nats_end_to_end(loop_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(loop_config(RUN, weights_transport="nats"))
    assert 'weights_transport = "nats"' in config.read_text()
    with NatsServer(store_dir=tmp_path / "nats") as nats:
        st = LoopStack(tmp_path, RUN, nats.url, loop_model, config)
        try:
            st.start(st.engine(0), st.engine(1))
            sync = st.sync()
            # sync gets a weights root of its own: it must not need the trainer's files
            sync.env["FLYWHEEL_SYNC_WEIGHTS_ROOT"] = str(tmp_path / "sync-has-no-weights")
            st.start(st.rollout(0), st.rollout(1), sync, st.trainer())
            st.start(st.buffer())
            wait_for(lambda: st.trained_steps() >= 4, 120, "four trainer steps")
            wait_for(lambda: all((st.engine_version(i) or 0) >= 4 for i in (0, 1)), 30,
                     "both engines at v4")  # fmt: skip
            pubs = messages(st.nats_url, RUN, "WEIGHTS", S.weights_published, WeightsPublished)
            assert pubs and all(p.uri.startswith("nats://") for p in pubs), pubs
            for i in (0, 1):
                # each engine loaded its own verified copy, not the trainer's directory
                local = (tmp_path / f"engine-weights-{i}").resolve()
                assert Path(st.model_path(i)).is_relative_to(local), st.model_path(i)
                got = st.procs[f"rollout-{i}"].metric("flywheel_rollout_weights_downloaded_version")
                assert got is not None and got >= 4
            # keep_last = 2: the chunks of old versions leave the stream
            wait_for(lambda: 1 not in chunk_versions(st.nats_url), 30, "v1 chunks purged")
            assert chunk_versions(st.nats_url), "the newest versions' chunks are kept"
        except BaseException:
            print(st.logs())
            raise
        finally:
            st.stop_all()


@pytest.fixture(autouse=True)
def _no_shared_dir_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYWHEEL_SYNC_WEIGHTS_ROOT", raising=False)

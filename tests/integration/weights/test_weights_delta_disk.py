"""The disk-delta weights transport: engines rebuild from the delta files beside the full dirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.weights import BadWeightsUri, Wiring, read_manifest, version_dir
from services.weights.deltasync import DELTA_FILE, delta_dir
from services.weights.diskdelta import DiskDeltaTransport
from tests.harness.weights import Policy, announced, same_files


def test_engines_rebuild_from_delta_files_and_copy_whole_when_one_is_bad(
    tmp_path: Path, run_async
) -> None:
    run, root = "dd", tmp_path / "root"
    trainer = DiskDeltaTransport(Wiring(run, root))
    engine = DiskDeltaTransport(Wiring(run))
    policy = Policy()

    async def body() -> None:
        held = None
        for v in range(1, 5):
            policy.step()
            src = policy.save(root, run, v)
            sent = await trainer.publish(v, src)
            assert sent.uri == f"filedelta://{src.resolve()}"
            assert trainer.source(sent.uri, v).engine_path(str(tmp_path / "e"), v) is not None
            if v == 3:  # corrupt the delta into v3 on the shared disk: the engine copies v3
                f = delta_dir(src) / DELTA_FILE
                data = bytearray(f.read_bytes())
                data[-10] ^= 1
                f.write_bytes(bytes(data))
            msg = announced(run, v, sent.uri, src)
            got = await engine.receive(msg, tmp_path / "e", newer_than=held)
            assert got is not None
            assert got.deltas == (1 if v in (2, 4) else 0)
            if v in (2, 4):
                assert got.bytes < 0.2 * msg.size_bytes
            local = version_dir(tmp_path / "e", v)
            assert read_manifest(local).sha256 == msg.sha256
            same_files(local, src)
            held = v
        await trainer.cleanup(below=4)
        assert sorted(p.name for p in (root / run).glob("*.delta")) == ["v000004.delta"]

    run_async(body())


@pytest.mark.parametrize(
    "uri",
    [
        "filedelta:///etc/v000001",
        "filedelta:///x/otherrun/v000001",
        "file:///x/dd/v000001",
        "filedelta:///x/dd/v000002",
    ],
)
def test_a_uri_outside_this_runs_versions_is_refused(uri: str) -> None:
    with pytest.raises(BadWeightsUri):
        DiskDeltaTransport(Wiring("dd")).source(uri, 1)

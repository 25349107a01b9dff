"""The NATS weights transport against a real nats-server: round trip, integrity, purge."""

from __future__ import annotations

import random
from pathlib import Path

import nats
import pytest

from proto.streams import streams_for
from services.runtime.nats_conn import ensure_streams
from services.stack.localdev.nats_server import NatsServer
from services.weights import write_weights_dir
from services.weights.chunks import (
    WeightsTransferError,
    download,
    plan_chunks,
    purge,
    upload,
)

RUN = "wn"
MAX_PAYLOAD = 64 * 1024  # small, so a few hundred KB take many chunks


def make_dir(root: Path, seed: int) -> Path:
    def write(tmp: Path) -> None:
        rng = random.Random(seed)
        (tmp / "model.safetensors").write_bytes(rng.randbytes(300_000))
        (tmp / "config.json").write_text(f'{{"seed": {seed}}}')
        (tmp / "sub").mkdir()
        (tmp / "sub" / "empty.bin").write_bytes(b"")

    write_weights_dir(root / f"v{seed}", write)
    return root / f"v{seed}"


def test_plan_covers_every_byte_once(tmp_path: Path) -> None:
    d = make_dir(tmp_path, 1)
    from services.weights import read_manifest

    m = read_manifest(d)
    pieces = plan_chunks(m, MAX_PAYLOAD)
    assert pieces[0].file == "flywheel-manifest.json" and pieces[0].offset == 0
    for f in m.files:
        mine = [p for p in pieces if p.file == f.name]
        assert sum(p.size for p in mine) == f.size
        assert [p.offset for p in mine] == sorted({p.offset for p in mine})
    assert [p.index for p in pieces] == list(range(len(pieces)))


def test_round_trip_and_purge(tmp_path: Path, run_async) -> None:
    src = make_dir(tmp_path / "src", 7)
    from services.weights import read_manifest

    digest = read_manifest(src).sha256

    async def body() -> None:
        with NatsServer() as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js, streams_for(RUN))
            sent = await upload(js, RUN, 3, src, max_payload=MAX_PAYLOAD)
            assert sent.chunks > 4
            # twice: the deterministic ids make the second upload a no-op in the stream
            await upload(js, RUN, 3, src, max_payload=MAX_PAYLOAD)
            got = await download(js, RUN, 3, digest, tmp_path / "dst" / "v000003")
            assert got.chunks == sent.chunks and got.bytes == sent.bytes
            for name in ("model.safetensors", "config.json", "sub/empty.bin"):
                assert (tmp_path / "dst" / "v000003" / name).read_bytes() == (
                    src / name
                ).read_bytes()
            assert not [p for p in (tmp_path / "dst").iterdir() if p.name.startswith(".")]
            # chunks of another digest are not taken for this one, and nothing is left
            with pytest.raises(WeightsTransferError, match=f"{sent.chunks} of another"):
                await download(js, RUN, 3, "0" * 64, tmp_path / "bad" / "v000003",
                               idle_timeout_s=1)  # fmt: skip
            assert not (tmp_path / "bad" / "v000003").exists()
            await purge(js, RUN, 3)
            with pytest.raises(WeightsTransferError, match="no chunk"):
                await download(js, RUN, 3, digest, tmp_path / "gone" / "v000003",
                               idle_timeout_s=0.5)  # fmt: skip
            await nc.close()

    run_async(body())


def test_corrupt_chunk_is_detected(tmp_path: Path, run_async) -> None:
    """A chunk whose bytes were altered (same ids and digest) fails the manifest check."""
    src = make_dir(tmp_path / "src", 9)
    from services.weights import read_manifest

    digest = read_manifest(src).sha256
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in src.rglob("*"):
        if p.is_file():
            q = bad / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            q.write_bytes(p.read_bytes())
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[100_000] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(data))  # manifest unchanged: now a lie

    async def body() -> None:
        with NatsServer() as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js, streams_for(RUN))
            await upload(js, RUN, 1, bad, max_payload=MAX_PAYLOAD)
            with pytest.raises(WeightsTransferError, match="sha256"):
                await download(js, RUN, 1, digest, tmp_path / "dst" / "v000001", idle_timeout_s=2)
            assert not (tmp_path / "dst" / "v000001").exists()
            await nc.close()

    run_async(body())


def test_receiver_hashes_in_order_and_leaves_out_of_order_files_to_verify(tmp_path: Path) -> None:
    """Files that arrived in order are hashed on the way in; others are re-read by verify."""
    import hashlib

    from services.weights import WeightsMismatchError, build_manifest, verify_weights_dir
    from services.weights.chunks import _Receiver

    rng = random.Random(3)
    a, b = rng.randbytes(5000), rng.randbytes(5000)
    rx = _Receiver(tmp_path)
    rx.write("a.bin", 0, a[:2000])
    rx.write("a.bin", 2000, a[2000:])
    rx.write("b.bin", 2500, b[2500:])  # the second half first
    rx.write("b.bin", 0, b[:2500])
    digests = rx.digests()
    rx.close()
    assert digests == {"a.bin": hashlib.sha256(a).hexdigest()}
    m = build_manifest(tmp_path)
    (tmp_path / "flywheel-manifest.json").write_text(m.to_json())
    assert verify_weights_dir(tmp_path, digests) == m
    # a digest claimed for bytes that differ from the manifest is caught
    with pytest.raises(WeightsMismatchError, match=r"a\.bin"):
        verify_weights_dir(tmp_path, {"a.bin": "0" * 64})

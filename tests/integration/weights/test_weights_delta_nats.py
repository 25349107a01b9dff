"""The nats-delta weights transport against a real nats-server.

Exact rebuilds version after version, a late joiner from the last snapshot
plus deltas, and every way a delta can go bad (missing chunk, corrupt chunk,
a well-formed delta that rebuilds other bytes) ending in a full download of
the right weights, never in wrong ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import nats
import pytest

from proto.codec import decode
from proto.messages import WeightsChunk
from proto.streams import stream_name, streams_for
from proto.subjects import Subjects
from services.runtime.nats_conn import ensure_streams
from services.stack.localdev.nats_server import NatsServer
from services.weights import (
    Wiring,
    published_dir,
    read_manifest,
    version_dir,
    write_weights_dir,
)
from services.weights.base import WeightsTransferError
from services.weights.chunks import purge, upload
from services.weights.deltasync import DELTA_FILE, delta_dir
from services.weights.natsdelta import NatsDeltaTransport
from tests.harness.weights import Policy, announced, same_files

MAX_PAYLOAD = 64 * 1024


async def connect(server: NatsServer, run: str) -> tuple[Any, Any]:
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(run))
    return nc, js


def transports(tmp_path: Path, run: str, nc: Any, js: Any, every: int) -> tuple[Any, Any]:
    trainer = NatsDeltaTransport(
        Wiring(run, tmp_path / "root", js, nc, max_payload=MAX_PAYLOAD, snapshot_every=every)
    )
    engine = NatsDeltaTransport(
        Wiring(run, js=js, nc=nc, max_payload=MAX_PAYLOAD, idle_timeout_s=1.5)
    )
    return trainer, engine


def test_each_version_is_rebuilt_exactly_from_deltas(tmp_path: Path, run_async) -> None:
    run = "dx"

    async def body() -> None:
        with NatsServer() as server:
            nc, js = await connect(server, run)
            trainer, engine = transports(tmp_path, run, nc, js, every=4)
            policy, held = Policy(), None
            for v in range(1, 7):
                policy.step()
                src = policy.save(tmp_path / "root", run, v)
                sent = await trainer.publish(v, src)
                assert sent.uri.endswith(f"/{v}?snapshot={1 if v < 5 else 5}")
                if v > 1:
                    assert sent.delta is not None and 0 < sent.delta.fraction_changed < 0.05
                    assert sent.delta.ratio < 0.2
                msg = announced(run, v, sent.uri, src)
                got = await engine.receive(msg, tmp_path / "engine", newer_than=held)
                assert got is not None and got.version == v
                # every version but the first came as one delta, far smaller than the whole
                assert got.deltas == (0 if v == 1 else 1)
                if v > 1:
                    assert got.bytes < 0.2 * msg.size_bytes
                same_files(version_dir(tmp_path / "engine", v), src)
                held = v
            assert await engine.receive(msg, tmp_path / "engine", newer_than=held) is None
            await nc.close()

    run_async(body())


def test_a_late_joiner_gets_version_37_from_the_snapshot_and_deltas(
    tmp_path: Path, run_async
) -> None:
    run = "dl"

    async def body() -> None:
        with NatsServer() as server:
            nc, js = await connect(server, run)
            trainer, engine = transports(tmp_path, run, nc, js, every=10)
            policy = Policy()
            for v in range(1, 38):
                policy.step()
                sent = await trainer.publish(v, policy.save(tmp_path / "root", run, v))
            assert sent.uri.endswith("/37?snapshot=31")  # v1 then every 10th: 1, 11, 21, 31
            await trainer.cleanup(below=37)  # keeps the snapshot 31 and what follows
            src = published_dir(tmp_path / "root", run, 37)
            msg = announced(run, 37, sent.uri, src)
            got = await engine.receive(msg, tmp_path / "late", newer_than=None)
            assert got is not None and got.deltas == 6  # 32..37 onto the snapshot 31
            local = version_dir(tmp_path / "late", 37)
            assert read_manifest(local).sha256 == msg.sha256
            same_files(local, src)
            assert not trainer.served  # nothing was uploaded again on demand
            await nc.close()

    run_async(body())


async def _tamper(js: Any, run: str, root: Path, version: int, how: str) -> None:
    """Replace the delta chunks of `version` in the stream by bad ones (see the test)."""
    subject = Subjects(run).weightdelta(version)
    if how == "missing":  # one chunk of the delta is gone
        sub = await js.subscribe(
            subject, stream=stream_name(run, "WEIGHTDATA"), ordered_consumer=True
        )
        m = await sub.next_msg(timeout=2)
        last = m.metadata.sequence.stream
        while decode(m.data, WeightsChunk).index < decode(m.data, WeightsChunk).count - 1:
            m = await sub.next_msg(timeout=2)
            last = m.metadata.sequence.stream
        await sub.unsubscribe()
        await js.delete_msg(stream_name(run, "WEIGHTDATA"), last)
        return
    good = (delta_dir(published_dir(root, run, version)) / DELTA_FILE).read_bytes()
    bad = bytearray(good)
    bad[len(bad) - 10] ^= 0x01  # inside the last tensor's new values
    forged = root / "forged" / f"d{version}"
    if how == "corrupt-chunk":  # bytes that no longer match the chunks' own manifest
        write_weights_dir(forged, lambda tmp: (tmp / DELTA_FILE).write_bytes(good))
        (forged / DELTA_FILE).write_bytes(bytes(bad))
    else:  # "wrong-delta": a consistent publication that rebuilds other weights
        write_weights_dir(forged, lambda tmp: (tmp / DELTA_FILE).write_bytes(bytes(bad)))
    await purge(js, run, version, subject)
    await upload(js, run, version, forged, max_payload=MAX_PAYLOAD, subject=subject)


@pytest.mark.parametrize("how", ["missing", "corrupt-chunk", "wrong-delta"])
def test_a_bad_delta_falls_back_to_the_full_version(tmp_path: Path, run_async, how: str) -> None:
    run = "db"

    async def body() -> None:
        with NatsServer() as server:
            nc, js = await connect(server, run)
            trainer, engine = transports(tmp_path, run, nc, js, every=100)
            policy = Policy()
            for v in (1, 2, 3):
                policy.step()
                src = policy.save(tmp_path / "root", run, v)
                sent = await trainer.publish(v, src)
                if v == 1:
                    got = await engine.receive(
                        announced(run, 1, sent.uri, src), tmp_path / "engine", None
                    )
                    assert got is not None and got.deltas == 0
            await _tamper(js, run, tmp_path / "root", 2, how)
            msg = announced(run, 3, sent.uri, src)
            got = await engine.receive(msg, tmp_path / "engine", newer_than=1)
            # the chain 1 → 2 → 3 is broken at 2: v3 came whole, uploaded on demand
            assert got is not None and got.deltas == 0 and got.bytes >= msg.size_bytes
            assert trainer.served == [3]
            same_files(version_dir(tmp_path / "engine", 3), src)
            assert not [p for p in (tmp_path / "engine").iterdir() if p.name.startswith(".")]
            await nc.close()

    run_async(body())


def test_no_usable_delta_and_no_full_version_means_no_weights(tmp_path: Path, run_async) -> None:
    """The trainer no longer has the version whole: the receive fails, nothing is written."""
    run = "dn"

    async def body() -> None:
        with NatsServer() as server:
            nc, js = await connect(server, run)
            trainer, engine = transports(tmp_path, run, nc, js, every=100)
            policy = Policy()
            for v in (1, 2):
                policy.step()
                src = policy.save(tmp_path / "root", run, v)
                sent = await trainer.publish(v, src)
            await _tamper(js, run, tmp_path / "root", 2, "wrong-delta")
            msg = announced(run, 2, sent.uri, src)
            shutil.rmtree(src)  # as sync's clean-up would, once no engine needed it
            with pytest.raises(WeightsTransferError, match="refused"):
                await engine.receive(msg, tmp_path / "engine", newer_than=None)
            # the snapshot v1 it fetched on the way stays (verified); no v2, no partial files
            assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == ["v000001"]
            await nc.close()

    run_async(body())

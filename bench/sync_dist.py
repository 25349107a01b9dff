"""The `distributed` row of bench/sync_deltas.py: sync's rank 0 broadcasting to engine processes.

What runs is the product's code on both sides of SGLang's protocol:

- rank 0 (this process) is `DistTransport` as sync holds it: `publish`
  (the `dist://` URI), `source(...).load(...)` per engine, which is
  `Groups.update` — read the version's safetensors, `/begin_weight_update`,
  `/update_weights_from_distributed` while `broadcast_tensors` sends them,
  `/end_weight_update` — through a real `EngineClient`. As sync does, every
  engine's update is its own task (sync's reconcile starts one per due
  engine) on its own two-rank gloo group, so N receivers cost N reads and
  N sends from rank 0. It runs on an event loop of its own in a thread,
  with Python's default executor as the sync process has: the bench's
  2-thread one would queue the groups' blocking joins one behind another,
  which sync does not.
- each receiver is a separate process (`--receive`) serving the engine's
  own routes (`services/engine/dist_api.py`: `join_group` and
  `receive_tensors` on the engine's real `Scheduler` thread) over aiohttp.
  Only the model is left out: the runner's `load_named` is a stand-in that
  hashes the received tensors, laid out as the held shard's safetensors,
  into the directory digest (`Verifier`). A real CPU engine per receiver
  would also run its model's load (excluded from every other row) and hold
  a 191M model each: 16 of them on 2 cores and ~20 GB would measure the
  machine, not the transport.

ready = every receiver answered its update and holds tensors whose
directory digest (the shard as laid out in the file, plus the held
config.json's hash) equals the trainer's manifest sha256, the same check the other rows
make. The engine in production does not hash what it receives; the bench
does, so the rows compare like for like (the receivers' hashing time is
reported beside it). Group formation (one two-rank group per engine, at an
engine's first update in sync, then reused) is not in publish→ready: it is
timed on its own, all N groups formed at once as sync would.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.engine_api.sglang_api import Capabilities  # noqa: E402
from services.weights import published_dir, read_manifest  # noqa: E402
from services.weights.base import Wiring  # noqa: E402
from services.weights.manifest import FileEntry, directory_digest  # noqa: E402

RELEASE = "0.5.23"  # the newest release read: updates run inside begin/end_weight_update
START_S = 120.0  # a receiver imports torch and the engine's modules on shared cores


class Verifier:
    """The engine's model runner, minus the model: what it received, hashed as published.

    v1 and v2 share names, dtypes and shapes, so v2's shard is v1's header
    bytes followed by v2's tensor bytes at the header's offsets: hashing
    those as they lie in the received tensors gives the file's sha256
    without a second copy (16 receivers × 381 MB serialised would crowd a
    shared machine). A tensor with other bytes, or a layout that is not
    v1's, gives another digest.
    """

    def __init__(self, held: Path) -> None:
        files = read_manifest(held).files
        shards = [f for f in files if f.name.endswith(".safetensors")]
        assert len(shards) == 1, "the bench publishes one shard"  # names → shard unknown else
        self.shard = shards[0]
        self.others = [f for f in files if f is not shards[0]]
        with open(held / self.shard.name, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = n.to_bytes(8, "little") + f.read(n)
        layout = json.loads(self.header[8:])
        layout.pop("__metadata__", None)
        self.order = sorted(layout, key=lambda name: layout[name]["data_offsets"][0])
        self.sha256 = ""
        self.verify_s = 0.0

    def load_named(self, weights: list[tuple[str, Any]]) -> None:
        import torch

        t = time.perf_counter()
        got = dict(weights)
        h = hashlib.sha256(self.header)
        size = len(self.header)
        for name in self.order:
            raw = got[name].contiguous().reshape(-1).view(torch.uint8).numpy()  # no copy
            h.update(raw)
            size += raw.nbytes
        entry = FileEntry(self.shard.name, size, h.hexdigest())
        self.sha256 = directory_digest(sorted([*self.others, entry], key=lambda e: e.name))
        self.verify_s = time.perf_counter() - t


async def serve(held: Path) -> None:
    """One receiver: the engine's distributed routes on a real scheduler; its URL on stdout;
    exits when stdin closes."""
    import torch
    from aiohttp import web

    from services.engine import dist_api
    from services.engine.scheduler import Scheduler
    from services.engine.state import STATE

    torch.set_num_threads(1)  # 16 of these share 2 cores
    caps = Capabilities.of(RELEASE)
    verifier = Verifier(held)
    scheduler = Scheduler(cast(Any, verifier), frozenset(), lambda ids, skip: "", caps=caps)
    scheduler.start()
    # dist_api reads only `scheduler` and `caps` from the engine's state
    state = cast(Any, SimpleNamespace(scheduler=scheduler, caps=caps))
    app = web.Application()
    app[STATE] = state
    dist_api.add_routes(app, state)

    async def held_now(_: web.Request) -> web.Response:
        return web.json_response({"sha256": verifier.sha256, "verify_s": verifier.verify_s})

    app.router.add_get("/held", held_now)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # the bench closes our stdin: done
    scheduler.stop()
    await runner.cleanup()


class Receivers:
    """`n` receiver processes holding `held` (v1); `urls` once all listen."""

    def __init__(self, n: int, held: Path) -> None:
        self.n, self.held = n, held
        self.procs: list[subprocess.Popen[str]] = []
        self.urls: list[str] = []

    def __enter__(self) -> Receivers:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--receive", str(self.held)]
        for _ in range(self.n):
            self.procs.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
        deadline = time.monotonic() + START_S
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()  # "" if it died: its traceback is on stderr
            if not line.startswith("http://") or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"a receiver did not start: {line!r}")
            self.urls.append(line)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def measure(v2: Path, urls: list[str], root: Path) -> dict[str, Any]:
    """publish→ready of v2 to `urls`, as sync updates its engines; groups formed first."""
    from services.engine_api.engine_client import EngineClient
    from services.weights.distributed import DistTransport

    src2 = published_dir(root, "benchdelta", 2)
    shutil.copytree(v2, src2, dirs_exist_ok=True)
    want = read_manifest(src2)
    transport = DistTransport(Wiring("benchdelta", root))
    caps = Capabilities.of(RELEASE)
    clients = [EngineClient(u, capabilities=caps, retries=2) for u in urls]
    try:
        t = time.perf_counter()
        await asyncio.gather(*(transport.groups.group(c) for c in clients))
        formed_s = time.perf_counter() - t

        t = time.perf_counter()
        sent = await transport.publish(2, src2)
        source = transport.source(sent.uri, 2)
        path = source.engine_path(None, None)
        assert path is not None
        done = await asyncio.gather(*(source.load(c, path, 2, "wait") for c in clients))
        held = await asyncio.gather(*(c.request("GET", "/held") for c in clients))
        seconds = time.perf_counter() - t
        assert all(r.success for r in done), [r.message for r in done]
        assert all(h["sha256"] == want.sha256 for h in held), "a receiver's tensors differ"
    finally:
        for c in clients:  # both ends leave the group, so the next count re-forms its own
            name = transport.groups.groups.get(c.url, (None, None))[1]
            transport.groups.drop(c.url)
            if name is not None:
                await c.request("POST", "/destroy_weights_update_group", {"group_name": name})
            await c.close()
        shutil.rmtree(src2.parent, ignore_errors=True)
    shard = sum(f.size for f in want.files if f.name.endswith(".safetensors"))
    return {
        "receivers": len(urls),
        "kind": "distributed",
        "seconds": seconds,
        "bytes_per_receiver": shard,
        "formed_s": formed_s,
        "verify_s": max(h["verify_s"] for h in held),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description="a receiver process of the distributed row")
    p.add_argument("--receive", type=Path, required=True, help="the held (v1) directory")
    asyncio.run(serve(p.parse_args(argv).receive))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Weight-sync benchmark: publish→ready latency against model size, both transports.

    .venv/bin/python bench/sync.py [--sizes 1m,10m,100m] [--reps 3]
    .venv/bin/python bench/sync.py --deltas [--size 191m]   # sparse deltas: bench/sync_deltas.py

For each model size (tiny Qwen2 shapes of ~1M, ~10M, ~100M parameters,
fp32 safetensors) one real CPU engine and the real sync service
(subprocesses) run against an embedded nats-server; this script plays the
trainer (writes the weights directory, publishes WeightsPublished) and, for
the NATS transport, the rollout worker beside the engine (downloads the
chunks, reports the copy in its heartbeat).

- disk: publish a `file://` version → WeightsReady. The engine checks the
  manifest and loads the safetensors: once with its default
  `weights_check = "sha256"` (every file re-hashed), once with "sizes"
  (names and sizes; a second engine process).
- nats: upload the chunks (trainer) → publish → download + verify + rename
  (worker) → heartbeat → engine load → WeightsReady. Also reported: the
  transport alone, bytes / (upload + download seconds).
- baselines, measured in the same run: a raw copy (`shutil.copyfile`) of the
  same files to a fresh directory on the same filesystem; and plain
  JetStream publish and ordered-consumer read of the same bytes in the same
  piece sizes (what nats-server and nats-py can do here at all).

Also the CPU seconds the sync process and the engine process spent per
version, publish to WeightsReady (utime + stime from /proc, in clock ticks
of 10 ms; sync's include its idle ticks at `tick_s = 0.01` over that time):
what a version costs those two processes (issue 45; the trainer's side and
an engine's load by stage: bench/version_cost.py).

Targets (issue 6): disk publish→ready ≤ 1.5× the raw copy; NATS transport
≥ 500 MB/s on loopback. Medians of `--reps` versions per size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proto.codec import decode  # noqa: E402
from proto.messages import EngineHeartbeat, WeightsPublished, WeightsReady  # noqa: E402
from proto.streams import streams_for, weights_nats_uri  # noqa: E402
from proto.subjects import Subjects  # noqa: E402
from services.runtime.publish import publish  # noqa: E402

RUN = "benchsync"
SIZES = {  # name → (hidden, layers): params ≈ 16·h²·layers (intermediate = 4h)
    "1m": (128, 4),
    "10m": (256, 10),
    "100m": (768, 10),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=30) as r:  # /health_generate takes >= 1 s
                if r.status == 200:
                    return
        except OSError:
            pass  # not up yet
        time.sleep(0.2)
    raise TimeoutError(url)


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip


async def raw_jetstream_s(js, src: Path, max_payload: int, window: int = 16) -> tuple[float, float]:
    """Seconds to publish the same bytes as plain JetStream messages, and to read them back.

    The ceiling the NATS transport is measured against: the same files in
    pieces of the transport's chunk size, `window` publishes in flight (as
    `upload`), read back by an ordered push consumer (as `download`) that
    only counts the bytes: no codec, no files written, no hashing.
    """
    from services.weights import read_manifest
    from services.weights.chunks import _read_pieces, plan_chunks, purge

    pieces = plan_chunks(read_manifest(src), max_payload)
    version = 10**9 + time.monotonic_ns() % 10**6  # a scratch subject in the same stream
    subject = Subjects(RUN).weightdata(version)
    t = time.perf_counter()
    pending: set[asyncio.Future] = set()
    for _, data in _read_pieces(src, pieces):
        pending.add(asyncio.ensure_future(js.publish(subject, data)))
        if len(pending) >= window:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*pending)
    pub_s = time.perf_counter() - t
    t = time.perf_counter()
    sub = await js.subscribe(subject, ordered_consumer=True)
    for _ in pieces:
        await sub.next_msg(timeout=30)
    sub_s = time.perf_counter() - t
    await sub.unsubscribe()
    await purge(js, RUN, version)
    return pub_s, sub_s


def raw_copy_s(src: Path, dst_root: Path) -> float:
    dst = dst_root / f"copy-{time.monotonic_ns()}"
    dst.mkdir(parents=True)
    t = time.perf_counter()
    for p in sorted(src.iterdir()):
        if p.is_file():
            shutil.copyfile(p, dst / p.name)
    took = time.perf_counter() - t
    shutil.rmtree(dst)
    return took


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class Bench:
    def __init__(self, nc, js, root: Path, max_payload: int) -> None:
        self.nc, self.js, self.root = nc, js, root
        self.max_payload = max_payload
        self.s = Subjects(RUN)
        self.ready: dict[int, float] = {}
        self.hb: EngineHeartbeat | None = None
        self.version = 0
        self.beating: asyncio.Task[None] | None = None
        self.pids: dict[str, int] = {}  # "sync", "engine": whose CPU a version costs

    async def start(self) -> None:
        async def on_ready(msg) -> None:
            r = decode(msg.data, WeightsReady)
            self.ready.setdefault(r.version, time.perf_counter())

        await self.nc.subscribe(self.s.weights_ready, cb=on_ready)
        self.beating = asyncio.create_task(self.heartbeats())

    async def heartbeats(self) -> None:
        while True:
            if self.hb is not None:
                await self.nc.publish(self.s.heartbeat(self.hb.engine_id), _enc(self.hb))
            await asyncio.sleep(0.1)

    def beat(self, engine_id: str, url: str, version: int, local: Path | None, dl: int | None):
        self.hb = EngineHeartbeat(
            run=RUN, engine_id=engine_id, url=url, worker_id="bench", weight_version=version,
            local_weights_dir=str(local) if local else None, downloaded_version=dl,
        )  # fmt: skip

    async def wait_ready(self, v: int, timeout_s: float = 300) -> float:
        deadline = time.monotonic() + timeout_s
        while v not in self.ready:
            if time.monotonic() > deadline:
                raise TimeoutError(f"v{v} never ready")
            await asyncio.sleep(0.002)
        return self.ready[v]

    async def announce(self, v: int, uri: str, m) -> None:
        msg = WeightsPublished(run=RUN, version=v, step=v, uri=uri, sha256=m.sha256,
                               size_bytes=m.total_bytes, published_at=time.time())  # fmt: skip
        await publish(self.js, self.s.weights_published, msg, self.max_payload)


def _enc(msg) -> bytes:
    from proto.codec import encode

    return encode(msg)


LIVENESS_S = 2.0  # sync drops an engine this long after its last heartbeat


@contextlib.asynccontextmanager
async def engine_for(b: Bench, model: Path, name: str, check: str, tmp: Path, log_dir: Path):
    """A CPU engine with `weights_check = check`, registered with sync; gone again after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine_id = f"engine-{name}-{check}"
    engine = spawn([sys.executable, "-m", "services.engine", "--model", str(model),
                    "--port", str(port), "--weight-version", str(b.version)],
                   {"FLYWHEEL_ENGINE_NUM_THREADS": "4", "FLYWHEEL_ENGINE_WEIGHTS_CHECK": check},
                   log_dir / f"{engine_id}.log")  # fmt: skip
    local = tmp / "local" / engine_id
    b.pids["engine"] = engine.pid
    try:
        await asyncio.to_thread(wait_http, f"{url}/health_generate", engine)
        b.beat(engine_id, url, b.version, local, None)
        await asyncio.sleep(1.0)  # sync registers the engine
        yield engine_id, url, local
    finally:
        engine.terminate()
        engine.wait(15)
        b.hb = None
        await asyncio.sleep(LIVENESS_S + 0.5)  # sync forgets it before the next one


async def one_version(
    b: Bench, transport: str, model: Path, tmp: Path, engine: tuple[str, str, Path],
    out: dict[str, list[float]],
) -> int:  # fmt: skip
    """Publish one version by `transport` and time it to WeightsReady; returns its bytes."""
    from services.weights import published_dir, read_manifest, version_dir, write_weights_dir
    from services.weights.chunks import download, upload

    engine_id, url, local = engine
    b.version += 1
    v = b.version
    target = published_dir(tmp / "weights", RUN, v)

    def save(d: Path, src: Path = model) -> None:
        for p in src.iterdir():
            if p.is_file() and p.name != "flywheel-manifest.json":
                shutil.copyfile(p, d / p.name)

    m = await asyncio.to_thread(write_weights_dir, target, save)
    out["copy"].append(await asyncio.to_thread(raw_copy_s, target, tmp / "copies"))
    cpu0 = {who: proc_cpu_s(pid) for who, pid in b.pids.items()}
    t0 = time.perf_counter()
    if transport == "nats":
        up = await upload(b.js, RUN, v, target, max_payload=b.max_payload)
        await b.announce(v, weights_nats_uri(RUN, v), read_manifest(target))
        t1 = time.perf_counter()
        await download(b.js, RUN, v, m.sha256, version_dir(local, v))
        out["up"].append(up.seconds)
        out["down"].append(time.perf_counter() - t1)
        b.beat(engine_id, url, v - 1, local, v)
    else:
        await b.announce(v, target.resolve().as_uri(), m)
    done = await b.wait_ready(v)
    out[transport].append(done - t0)
    for who, pid in b.pids.items():
        out.setdefault(f"cpu_{who}_{transport}", []).append(proc_cpu_s(pid) - cpu0[who])
    if transport == "nats":  # after the timed path, so it does not add to it
        pub_s, sub_s = await raw_jetstream_s(b.js, target, b.max_payload)
        out["js_pub"].append(pub_s)
        out["js_sub"].append(sub_s)
    b.beat(engine_id, url, v, local, v if transport == "nats" else None)
    shutil.rmtree(target)
    return m.total_bytes


async def run_size(b: Bench, name: str, reps: int, tmp: Path, log_dir: Path) -> dict:
    from services.models.tiny_model import TinyModelSpec, write_tiny_model

    hidden, layers = SIZES[name]
    heads = max(4, hidden // 64)
    spec = TinyModelSpec(hidden_size=hidden, num_layers=layers, num_heads=heads,
                         num_kv_heads=heads, intermediate_size=4 * hidden)  # fmt: skip
    model = await asyncio.to_thread(write_tiny_model, tmp / f"model-{name}", spec)
    keys = ("copy", "disk", "disk_sizes", "up", "down", "nats", "js_pub", "js_sub")
    out: dict[str, list[float]] = {k: [] for k in keys}
    size = 0
    # The engine's default check (sha256 of every file) for both transports, then
    # one that checks names and sizes only, for the shared directory.
    for check, transports in (("sha256", ("disk", "nats")), ("sizes", ("disk_sizes",))):
        async with engine_for(b, model, name, check, tmp, log_dir) as engine:
            for transport in transports:
                for _ in range(reps):
                    size = await one_version(b, transport, model, tmp, engine, out)
    med = {k: statistics.median(x) for k, x in out.items()}
    return {"name": name, "params": spec_params(hidden, layers), "bytes": size, **med}


def spec_params(hidden: int, layers: int) -> int:
    return 16 * hidden * hidden * layers


async def main(args: argparse.Namespace) -> None:
    import nats

    from services.runtime.nats_conn import ensure_streams
    from services.stack.localdev.nats_server import NatsServer

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-sync-", dir=args.tmp))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    config = tmp / "run.toml"
    config.write_text(
        f'run = "{RUN}"\n[sync]\ntick_s = 0.01\nliveness_s = {LIVENESS_S}\nkeep_last = 1\n'
    )
    rows = []
    with NatsServer(store_dir=tmp / "nats") as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js, streams_for(RUN))
        port = free_port()
        env = {"FLYWHEEL_SYNC_NATS__URL": server.url, "FLYWHEEL_SYNC_METRICS_PORT": str(port),
               "FLYWHEEL_SYNC_WEIGHTS_ROOT": str(tmp / "weights")}  # fmt: skip
        sync = spawn([sys.executable, "-m", "services.sync", "-c", str(config)], env,
                     log_dir / "sync.log")  # fmt: skip
        try:
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/readyz", sync)
            b = Bench(nc, js, tmp, nc.max_payload)
            b.pids["sync"] = sync.pid
            await b.start()
            for name in args.sizes.split(","):
                row = await run_size(b, name, args.reps, tmp, log_dir)
                rows.append(row)
                print(fmt(row), flush=True)
        finally:
            sync.terminate()
            sync.wait(15)
            await nc.close()
    shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| model | params | bytes | raw copy | disk p→r | disk/copy | disk p→r, sizes check "
          "| /copy | NATS p→r | NATS/copy |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mb = r["bytes"] / 1e6
        print(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {mb:.1f} MB | {r['copy'] * 1e3:.0f} ms "
            f"| {r['disk'] * 1e3:.0f} ms | {r['disk'] / r['copy']:.2f}× "
            f"| {r['disk_sizes'] * 1e3:.0f} ms | {r['disk_sizes'] / r['copy']:.2f}× "
            f"| {r['nats'] * 1e3:.0f} ms | {r['nats'] / r['copy']:.2f}× |"
        )
    print()
    print("NATS transport against plain JetStream publish / ordered-consumer read of the same")
    print("bytes in the same run (the ceiling; no codec, no files, no hashing):")
    print()
    print("| model | upload | raw publish | up/raw | download | raw read | down/raw "
          "| up + down in series | raw in series |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mb = r["bytes"] / 1e6
        print(
            f"| {r['name']} | {mb / r['up']:.0f} MB/s | {mb / r['js_pub']:.0f} MB/s "
            f"| {r['js_pub'] / r['up']:.2f}× | {mb / r['down']:.0f} MB/s "
            f"| {mb / r['js_sub']:.0f} MB/s | {r['js_sub'] / r['down']:.2f}× "
            f"| {mb / (r['up'] + r['down']):.0f} MB/s "
            f"| {mb / (r['js_pub'] + r['js_sub']):.0f} MB/s |"
        )
    print()
    print("CPU seconds per version, publish → WeightsReady (median; /proc, 10-ms ticks):")
    print()
    print("| model | sync, disk | engine, disk (sha256 check) | engine, disk (sizes check) "
          "| sync, nats | engine, nats |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['cpu_sync_disk']:.3f} | {r['cpu_engine_disk']:.3f} "
            f"| {r['cpu_engine_disk_sizes']:.3f} | {r['cpu_sync_nats']:.3f} "
            f"| {r['cpu_engine_nats']:.3f} |"
        )


def fmt(r: dict) -> str:
    return (f"{r['name']}: {r['bytes'] / 1e6:.1f} MB copy {r['copy']:.3f}s disk {r['disk']:.3f}s "
            f"disk/sizes {r['disk_sizes']:.3f}s "
            f"nats up {r['up']:.3f}s down {r['down']:.3f}s p→r {r['nats']:.3f}s")  # fmt: skip


if __name__ == "__main__":
    if "--deltas" in sys.argv:  # bytes per version at RL learning rates, and delta transports
        sys.path.insert(0, str(Path(__file__).parent))
        from sync_deltas import main as deltas_main

        deltas_main([a for a in sys.argv[1:] if a != "--deltas"])
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1m,10m,100m")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tmp", default=None, help="where to write (default: the system temp dir)")
    asyncio.run(main(p.parse_args()))

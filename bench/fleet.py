"""Does generation scale out? N simulated engines against the real buffer and NATS.

    .venv/bin/python bench/fleet.py [--n 1 4 16 64 256] [--seconds 30]
                                    [--out bench/results_fleet.md]

What is real and what stands in:

- NATS: a real nats-server (JetStream, file store), as `flywheel up` starts it.
- Buffer: the real buffer service (`services.buffer.app.body`) in its own
  process: admission, assembly, the KV state written per group, batches.
- Rollout workers: the real `RolloutWorker` (its task handler: engine version
  check, tokenize, /generate over HTTP, reward, SampleGroup publish, its
  heartbeats), one per engine, in `--worker-procs` processes (default 2), the
  workers of one process sharing its NATS connection and verifier pool (a
  real deployment runs one process per engine; 256 do not fit on 2 cores).
  No weights fetcher: no weights move in this bench.
- Engines: `SyntheticScheduler` behind the real engine HTTP app
  (`services.engine.app.build_app`, so every route answers as SGLang does),
  no model: a sequence's completion arrives after `--latency-s` plus its
  tokens at `--tokens-per-s`; many engines per process (sub-apps of one
  aiohttp server, /e<i>/...).
- Trainer and sync: the stand-in trainer (bench only, `run_stand_in_trainer`)
  reads each TrainBatch (the trainer's BatchReader: chunks reassembled),
  sleeps `--step-s`, sets version step + 1 on every engine as sync does
  (POST /update_weights_from_disk with weight_version, all engines at
  once), then publishes WeightsReady(step + 1).

Figures per N, over `--seconds` after a warm-up: sustained groups/s (the
SAMPLES stream), task latency p50/p99 (a group's created_at − its task's
dispatch), NATS bytes/s (the server's /varz in+out), and CPU per process
(seconds of CPU per second: 1.0 is one core busy), which names the
component that saturates first.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RUN = "fleet"
TASK = {"source": {"type": "arithmetic", "digits": 2}, "reward": "exact_match"}


# ── engines ───────────────────────────────────────────────────────────────────
class NoWeights:
    """The model runner's weight loaders, with no model: a load only names its path."""

    def disk_loader(self, path: str) -> Any:
        return lambda: path


class SyntheticScheduler:
    """The engine scheduler's interface with no model: completions on a timer.

    Output tokens are a fixed pattern (digits, so the arithmetic reward runs
    on them), logprobs -1.0; `n_tokens` per sequence unless max_new_tokens is
    smaller. Runs on the server's event loop (the real one has a thread).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, args: argparse.Namespace) -> None:
        self.loop, self.args = loop, args
        self.weight_version = "0"
        self.crashed: str | None = None
        self.generated_tokens = 0
        self.running = 0
        self.runner = NoWeights()

    def alive(self) -> bool:
        return True

    def submit(self, spec: Any, on_done: Any) -> None:
        from services.engine.core.protocol import Completion

        n = min(self.args.tokens, spec.params.max_new_tokens)
        delay = self.args.latency_s + n / self.args.tokens_per_s
        t0, version = time.perf_counter(), self.weight_version
        self.running += 1

        def done() -> None:
            self.running -= 1
            self.generated_tokens += n
            ids = [20 + (i % 10) for i in range(n)]
            on_done(Completion(ids, [-1.0] * n, {"type": "length", "length": n}, version,
                               time.perf_counter() - t0, spans=[(version, 0, n)]))  # fmt: skip

        self.loop.call_later(delay, done)

    def _now(self, value: Any) -> Future[Any]:
        f: Future[Any] = Future()
        f.set_result(value)
        return f

    def abort(self, rid: str | None = None, abort_all: bool = False) -> Future[int]:
        return self._now(0)

    def pause(self, mode: str) -> Future[None]:
        return self._now(None)

    def resume(self) -> Future[None]:
        return self._now(None)

    def flush_possible(self) -> Future[bool]:
        return self._now(True)

    def update_weights(self, load: Any, version: str | None, abort_all: bool, flush: bool = True):
        load()
        if version is not None:
            self.weight_version = version
        return self._now((True, "Succeeded to update model weights.", 0))

    def load(self) -> dict[str, Any]:
        return {"num_running_reqs": self.running, "num_waiting_reqs": 0, "num_held_reqs": 0,
                "num_used_tokens": 0}  # fmt: skip


async def serve_engines(args: argparse.Namespace) -> None:
    """N engines as sub-apps of one aiohttp server (versions set as sync sets them)."""
    from aiohttp import web

    from services.engine.app import build_app
    from services.engine.loras import Loras
    from services.engine.probes import Health
    from services.engine.settings import EngineSettings
    from services.engine.state import EngineState

    loop = asyncio.get_running_loop()
    settings = EngineSettings(model=None, max_running_requests=args.concurrency * 4)
    caps = settings.capabilities
    tok = CharTokenizer()
    root, schedulers = web.Application(), []
    for i in range(args.n):
        sched = SyntheticScheduler(loop, args)
        schedulers.append(sched)
        state = EngineState(settings=settings, tokenizer=tok, scheduler=sched,  # type: ignore[arg-type]
                            vocab_size=1 << 16, context_len=4096, model_path="synthetic",
                            started=time.time(), caps=caps,
                            health=Health(caps, False, 5.0),
                            lora=Loras(None, caps, sched, None, 1 << 16))  # type: ignore[arg-type]  # fmt: skip
        root.add_subapp(f"/e{i}/", build_app(state))
    runner = web.AppRunner(root, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    await asyncio.Event().wait()


class CharTokenizer:
    """Enough of a tokenizer for the engine app: characters in, characters out."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(ord(c), 63) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 28) for i in ids)  # 20..29 -> "0".."9"


# ── workers ───────────────────────────────────────────────────────────────────
async def run_workers(args: argparse.Namespace) -> None:
    """One RolloutWorker per engine in this process (see the module docstring)."""
    from prometheus_client import CollectorRegistry

    from proto.messages import PromptTask
    from proto.streams import consumers_for
    from services.engine_api.engine_client import EngineClient
    from services.rollout.app import PromptTaskScorer, load_tokenizer
    from services.rollout.settings import RolloutSettings
    from services.rollout.worker import RolloutWorker
    from services.runtime.lifecycle import ServiceContext, run_service
    from services.runtime.settings import NatsSettings
    from services.tasks.scoring import Scorer, verifier_pool

    base = RolloutSettings(run=RUN, nats=NatsSettings(url=args.nats), task=TASK,
                           model=Path(args.model), concurrency=args.concurrency,
                           log_level="WARNING")  # fmt: skip

    async def body(ctx: ServiceContext) -> None:
        tasks = base.task_set()
        tokenizer = await asyncio.to_thread(load_tokenizer, base.model)
        async with verifier_pool(tasks, timeout_s=30.0) as pool:
            scorer = PromptTaskScorer(Scorer(tasks, pool))
            loops = []
            shard, shards = args.shard
            for i in range(shard, args.n, shards):
                s = base.model_copy(update={"engine_url": f"http://127.0.0.1:{args.port}/e{i}",
                                            "engine_id": f"engine-{i}",
                                            "worker_id": f"rollout-{i}"})  # fmt: skip
                client = await EngineClient(s.engine_url, timeout_s=60.0).__aenter__()
                # a registry each: every worker declares the same metrics
                own = dataclasses.replace(ctx, registry=CollectorRegistry(), settings=s)
                w = RolloutWorker(own, s, client, tokenizer, scorer)
                await w.wait_for_engine(ctx.stop)
                loops.append(asyncio.create_task(w.heartbeat_loop(ctx.stop)))
                loops.append(asyncio.create_task(own.consume(
                    consumers_for(RUN)["rollout"], PromptTask, w.on_task,
                    concurrency=s.concurrency, batch=s.concurrency)))  # fmt: skip
            ctx.readiness.ok("fleet")
            await asyncio.gather(*loops)

    await run_service("rollout", base, body)


# ── buffer and the stand-in trainer ───────────────────────────────────────────
async def run_buffer(args: argparse.Namespace) -> None:
    from services.buffer.app import body
    from services.buffer.settings import BufferSettings
    from services.runtime.lifecycle import run_service
    from services.runtime.settings import NatsSettings

    s = BufferSettings(run=RUN, nats=NatsSettings(url=args.nats), task=TASK,
                       samples_per_prompt=args.samples, groups_per_step=args.groups_per_step,
                       max_new_tokens=args.tokens, max_staleness=args.staleness,
                       filter_zero_variance=False, log_level="WARNING")  # fmt: skip
    await run_service("buffer", s, body)


async def run_stand_in_trainer(args: argparse.Namespace) -> None:
    """StandInTrainer: batch in, `--step-s` asleep, WeightsReady(step + 1) out (bench only)."""
    from proto.messages import WeightsReady
    from proto.subjects import Subjects
    from proto.weight_version import to_engine
    from services.runtime.lifecycle import ServiceContext, run_service
    from services.runtime.publish import publish
    from services.runtime.settings import ServiceSettings
    from services.trainer.batches import BatchReader

    class StandInSettings(ServiceSettings):
        section = "standin"

    s = StandInSettings(run=RUN, nats={"url": args.nats}, log_level="WARNING")

    async def body(ctx: ServiceContext) -> None:
        import aiohttp

        route = "update_weights_from_disk"
        urls = [f"http://127.0.0.1:{args.port}/e{i}/{route}" for i in range(args.n)]
        async with aiohttp.ClientSession() as http:

            async def update(url: str, v: int) -> None:
                body = {"model_path": f"/weights/v{v}", "weight_version": to_engine(v)}
                for attempt in range(10):  # sync retries an engine that does not answer
                    try:
                        async with http.post(url, json=body) as r:
                            r.raise_for_status()
                            return
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.2 * (attempt + 1))
                raise RuntimeError(f"engine {url} did not take version {v}")

            ctx.readiness.ok("trainer")
            trained = [0]
            async with BatchReader(ctx, RUN, 1) as reader:  # the trainer's own reader
                async for batch in reader.batches(lambda: trained[0], ctx.stop, None):
                    await asyncio.sleep(args.step_s)
                    v = trained[0] = batch.wire.step + 1
                    await asyncio.gather(*(update(u, v) for u in urls))
                    ready = WeightsReady(run=RUN, version=v, ready_at=time.time())
                    await publish(ctx.js, Subjects(RUN).weights_ready, ready, ctx.max_payload)

    await run_service("standin", s, body)


# ── measuring ─────────────────────────────────────────────────────────────────
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children that ended (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def varz(monitor: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{monitor}/varz", timeout=5) as r:
        return json.loads(r.read())


async def stream_state(url: str, since: int = 0, after: float = 0.0) -> tuple[int, list[float]]:
    """SAMPLES stream's last sequence, and the task latencies of (at most 400 of) the
    groups published after sequence `since` whose task was dispatched after `after`
    (not the start-up's backlog), evenly spread."""
    import nats

    from proto.codec import decode
    from proto.messages import SampleGroup
    from proto.streams import stream_name

    nc = await nats.connect(url)
    js = nc.jetstream()
    name = stream_name(RUN, "SAMPLES")
    try:
        last = (await js.stream_info(name)).state.last_seq
        lat = []
        for seq in range(since + 1, last + 1, max(1, (last - since) // 400)):
            g = decode((await js.get_msg(name, seq)).data or b"", SampleGroup)
            queued = min(x.queued_at for x in g.samples)
            if queued >= after:
                lat.append(g.created_at - queued)
    finally:
        await nc.close()
    return last, lat


def first_group(url: str, limit_s: float) -> None:
    """Wait until the fleet has stored a group (or `limit_s` passed: the window then
    measures whatever came, and a row of 0 groups/s says that nothing did)."""
    from nats.js.errors import NotFoundError

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            stored = asyncio.run(stream_state(url))[0]
        except NotFoundError:  # the buffer has not made its streams yet
            stored = 0
        if stored:
            return
        time.sleep(0.5)


def measure(args: argparse.Namespace, n: int, model: Path, tmp: Path) -> dict[str, Any]:
    """One fleet of `n` engines: start everything, warm up, measure, stop."""
    from services.stack.localdev.nats_server import NatsServer
    from services.stack.localdev.ports import free_port

    shutil.rmtree(tmp / f"nats-{n}", ignore_errors=True)  # a fresh run: no state to resume
    with NatsServer(store_dir=tmp / f"nats-{n}") as server:
        port = free_port()
        common = ["--nats", server.url, "--port", str(port), "--n", str(n), "--model", str(model)]
        common += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                   ("concurrency", "tokens", "tokens_per_s", "latency_s", "samples",
                    "staleness", "step_s")]  # fmt: skip
        common += ["--groups-per-step", str(window(args, n) // (args.staleness + 1))]
        procs = {}
        shards = min(n, args.worker_procs)
        roles = [("engines", ""), ("buffer", ""), ("trainer", "")]
        roles += [("workers", f"{i}/{shards}") for i in range(shards)]
        for role, shard in roles:
            name = f"{role}{shard.split('/')[0]}" if shard else role
            with (tmp / f"{name}-{n}.log").open("w") as log:  # the child keeps its own copy
                cmd = [sys.executable, __file__, "--role", role, *common]
                cmd += ["--shard", shard] if shard else []
                procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            pids = {r: p.pid for r, p in procs.items()} | {"nats": server.pid or 0}
            first_group(server.url, 60.0 + 0.5 * n)  # start-up: slower on a loaded machine
            time.sleep(args.warmup_s + 0.1 * n)  # the workers start one engine at a time
            seq0, _ = asyncio.run(stream_state(server.url))
            v0, t0 = varz(server.monitor_url), time.time()
            c0 = {r: cpu_seconds(p) for r, p in pids.items()}
            time.sleep(args.seconds)
            seq1, lat = asyncio.run(stream_state(server.url, seq0, t0))
            v1, t1 = varz(server.monitor_url), time.time()
            c1 = {r: cpu_seconds(p) for r, p in pids.items()}
            dead = [r for r, p in procs.items() if p.poll() is not None]
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait(timeout=30)
        dt = t1 - t0
        cpu = {r: (c1[r] - c0[r]) / dt for r in pids}
        nbytes = (v1["in_bytes"] + v1["out_bytes"] - v0["in_bytes"] - v0["out_bytes"]) / dt
        lat.sort()
        return {
            "n": n, "groups_per_s": (seq1 - seq0) / dt, "seconds": dt,
            "p50": statistics.median(lat) if lat else None,
            "p99": lat[int(0.99 * (len(lat) - 1))] if lat else None,
            "nats_bytes_per_s": nbytes, "cpu": cpu, "dead": dead, "window": window(args, n),
        }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["engines", "workers", "buffer", "trainer"])
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--seconds", type=float, default=30.0, help="measured window per N")
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=16, help="tasks in flight per worker")
    p.add_argument("--tokens", type=int, default=32, help="response tokens per sample")
    p.add_argument("--tokens-per-s", type=float, default=50.0, help="per sequence")
    p.add_argument("--latency-s", type=float, default=0.05, help="per request, before tokens")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (n)")
    p.add_argument("--groups-per-step", type=int, default=0,
                   help="0: (every worker's concurrency) / (k + 1), so admission's window "
                   "(k + 1) x G covers the fleet and does not cap it")  # fmt: skip
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--step-s", type=float, default=0.05, help="the stand-in trainer's step")
    p.add_argument("--nats"), p.add_argument("--port", type=int), p.add_argument("--model")
    p.add_argument("--worker-procs", type=int, default=2, help="processes the workers share")
    p.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)  # a workers process's part
    p.add_argument("--out", type=Path)
    p.add_argument("--work-dir", type=Path, help="keep the logs and stores here (default: temp)")
    args = p.parse_args(argv)
    if args.role is not None:
        args.n = args.n[0]
        args.shard = tuple(int(x) for x in args.shard.split("/"))
        role = {"engines": serve_engines, "workers": run_workers, "buffer": run_buffer,
                "trainer": run_stand_in_trainer}[args.role]  # fmt: skip
        asyncio.run(role(args))
        return 0
    from services.models.tiny_model import write_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="fleet-") as d:
        tmp = args.work_dir or Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        model = write_tiny_model(tmp / "model")  # only its tokenizer is used (the workers')
        for n in args.n:
            r = measure(args, n, model, tmp)
            print(json.dumps(r), flush=True)
            rows.append(r)
    md = table(rows, args)
    print(md)
    if args.out:
        args.out.write_text(md)
    return 0


def window(args: argparse.Namespace, n: int) -> int:
    """Tasks admission lets be in flight: (k + 1) x G."""
    g = args.groups_per_step or max(1, n * args.concurrency // (args.staleness + 1))
    return g * (args.staleness + 1)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    per_engine = args.concurrency / (args.latency_s + args.tokens / args.tokens_per_s)
    head = ("| engines | admission window | groups/s | ideal groups/s | task latency p50 / p99 (s) "
            "| NATS MB/s | CPU engines / workers / buffer / stand-in trainer / nats-server "
            "(cores) |\n|---|---|---|---|---|---|---|\n")  # fmt: skip
    lines = []
    for r in rows:
        c = r["cpu"]
        c["workers"] = sum(v for k, v in c.items() if k.startswith("workers"))
        lines.append(
            f"| {r['n']} | {r['window']} | {r['groups_per_s']:.1f} | {per_engine * r['n']:.0f} "
            f"| {r['p50'] or 0:.2f} / {r['p99'] or 0:.2f} | {r['nats_bytes_per_s'] / 1e6:.2f} "
            f"| {c['engines']:.2f} / {c['workers']:.2f} / {c['buffer']:.2f} / {c['trainer']:.2f} "
            f"/ {c['nats']:.2f} |" + (f" died: {r['dead']}" if r["dead"] else "")
        )
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

"""Wire benchmark: codec cost per sample, and JetStream throughput through the runtime.

    .venv/bin/python bench/wire.py [--messages 2000] [--rounds 5]

1. encode+decode µs of one Sample with 1k / 4k / 32k response tokens, as
   packed arrays (what proto does) against the same fields as MessagePack
   lists (the baseline), and against msgpack's own pack+unpack of the same
   map (the floor: what is left for validation and building the objects),
   measured in the same run.
2. publish→consume throughput of 4k-token SampleGroups through Flywheel's
   path (services.runtime.publish + MessageLoop: encode, Nats-Msg-Id,
   decode + validate, ack) against raw nats-py (publish the same bytes,
   pull-fetch and ack), against one embedded nats-server, in the same run.
   Besides wall-clock rates it reports this process's CPU µs per message
   (time.process_time; the server is another process): on a shared 2-core
   box the wall clock swings with other jobs, the CPU cost much less.
Prints ratios against the baselines; results go to bench/results_wire.md by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import msgpack
import numpy as np
from prometheus_client import CollectorRegistry

from proto.codec import decode, encode
from proto.messages import Sample, SampleGroup, pack_f32, pack_i32, pack_u8
from proto.streams import ConsumerSpec, StreamSpec
from services.runtime.msgloop import MessageLoop
from services.runtime.nats_conn import ensure_consumer, ensure_stream
from services.runtime.publish import publish
from services.stack.localdev.nats_server import NatsServer


def sample(tokens: int, prompt: int = 256) -> Sample:
    rng = np.random.default_rng(0)
    return Sample(
        sample_id="bench:e0:i0:a0:s0",
        group_id="bench:e0:i0:a0",
        task_id="bench:e0:i0",
        index=0,
        prompt_ids=pack_i32(rng.integers(0, 150_000, prompt)),
        response_ids=pack_i32(rng.integers(0, 150_000, tokens)),
        logprobs=pack_f32(-rng.random(tokens)),
        loss_mask=pack_u8(np.ones(tokens)),
        reward=1.0,
        finish_reason="stop",
        weight_version=3,
        weight_version_last=3,
        engine_id="engine-0",
    )


def per_call_us(fns: dict[str, Callable[[], object]], seconds: float = 1.0) -> dict[str, float]:
    """Median over 5 rounds of the mean µs per call, for each of `fns`.

    The functions take turns within every round, so a burst of load from
    another job hits all of them rather than one.
    """
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(5):
        for name, fn in fns.items():
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / 5 / len(fns):
                fn()
                n += 1
            rounds[name].append((time.perf_counter() - start) / n * 1e6)
    return {name: statistics.median(r) for name, r in rounds.items()}


def codec_bench(seconds: float) -> None:
    print("codec: encode+decode of one Sample (median µs per round trip)")
    print(
        f"{'tokens':>7} {'bytes':>8} {'packed':>9} {'as lists':>9} {'lists/packed':>13} "
        f"{'msgpack only':>13} {'packed/msgpack':>15}"
    )
    for tokens in (1024, 4096, 32768):
        s = sample(tokens)
        body = msgpack.unpackb(encode(s))  # the same map, as plain Python values
        as_lists = {
            **s.__dict__,
            "prompt_ids": np.frombuffer(s.prompt_ids, "<i4").tolist(),
            "response_ids": np.frombuffer(s.response_ids, "<i4").tolist(),
            "logprobs": np.frombuffer(s.logprobs, "<f4").tolist(),
            "loss_mask": list(s.loss_mask),
        }
        us = per_call_us(
            {
                "packed": lambda s=s: decode(encode(s), Sample),
                "lists": lambda d=as_lists: msgpack.unpackb(msgpack.packb(d)),
                "msgpack": lambda b=body: msgpack.unpackb(msgpack.packb(b)),
            },
            seconds,
        )
        packed, lists, floor = us["packed"], us["lists"], us["msgpack"]
        print(
            f"{tokens:>7} {len(encode(s)):>8} {packed:>9.2f} {lists:>9.2f} "
            f"{lists / packed:>12.1f}x {floor:>13.2f} {packed / floor:>14.2f}x"
        )


def group(i: int, tokens: int) -> SampleGroup:
    s = sample(tokens)
    return SampleGroup(
        run="bench", group_id=f"bench:g{i}", task_id=f"bench:t{i}", task_name="e", worker_id="w",
        samples=(s,),
    )  # fmt: skip


async def one_round(js, groups, payload: bytes, tag: str, max_payload: int) -> dict[str, float]:
    """Seconds to publish and to consume `len(groups)` messages, raw and through Flywheel."""
    n = len(groups)

    async def fresh(name: str) -> ConsumerSpec:
        await ensure_stream(js, StreamSpec(name, (f"bench.{name}",)))
        spec = ConsumerSpec("c", name, f"bench.{name}", max_ack_pending=100_000)
        await ensure_consumer(js, spec)
        return spec

    out: dict[str, float] = {}
    # raw nats-py: the same bytes, publish awaited one by one, pull-fetch + ack.
    await fresh(f"RAW{tag}")
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        await js.publish(f"bench.RAW{tag}", payload, headers={"Nats-Msg-Id": f"raw{i}"})
    out["raw_pub"], out["raw_pub_cpu"] = time.perf_counter() - t0, time.process_time() - c0
    sub = await js.pull_subscribe_bind("c", f"RAW{tag}")
    got, t0, c0 = 0, time.perf_counter(), time.process_time()
    while got < n:
        for m in await sub.fetch(100, timeout=5):
            await m.ack()
            got += 1
    out["raw_con"], out["raw_con_cpu"] = time.perf_counter() - t0, time.process_time() - c0
    await sub.unsubscribe()

    # Flywheel: publish() encodes each message; MessageLoop decodes, validates, acks.
    spec = await fresh(f"FLY{tag}")
    t0, c0 = time.perf_counter(), time.process_time()
    for g in groups:
        await publish(js, f"bench.FLY{tag}", g, max_payload)
    out["fly_pub"], out["fly_pub_cpu"] = time.perf_counter() - t0, time.process_time() - c0
    done = asyncio.Event()
    count = 0

    async def handle(msg: SampleGroup, _d: object) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    loop = MessageLoop(
        js, spec, SampleGroup, handle, run="bench", service="bench",
        registry=CollectorRegistry(), max_payload=max_payload, batch=100,
    )  # fmt: skip
    stop = asyncio.Event()
    t0, c0 = time.perf_counter(), time.process_time()
    runner = asyncio.create_task(loop.run(stop))
    await done.wait()
    out["fly_con"], out["fly_con_cpu"] = time.perf_counter() - t0, time.process_time() - c0
    stop.set()
    await runner
    for name in (f"RAW{tag}", f"FLY{tag}"):
        await js.delete_stream(name)  # keep the server's store small over many rounds
    return out


async def throughput(url: str, messages: int, tokens: int, rounds: int) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    groups = [group(i, tokens) for i in range(messages)]
    payload = encode(groups[0])
    size = len(payload)
    # Raw and Flywheel alternate, round after round, so load on the shared
    # machine hits both alike; the median round is reported.
    results = [await one_round(js, groups, payload, str(r), nc.max_payload) for r in range(rounds)]
    await nc.close()
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}

    mb = size * messages / 1e6
    print(f"\nJetStream, {messages} SampleGroups of one {tokens}-token sample ({size} B each), "
          f"median of {rounds} alternating rounds")  # fmt: skip
    print(f"{'path':<10} {'publish msg/s':>14} {'MB/s':>7} {'CPU µs/msg':>11} "
          f"{'consume msg/s':>14} {'MB/s':>7} {'CPU µs/msg':>11}")  # fmt: skip
    for name in ("raw", "fly"):
        pub, con = med[f"{name}_pub"], med[f"{name}_con"]
        pub_cpu, con_cpu = (med[f"{name}_{k}_cpu"] / messages * 1e6 for k in ("pub", "con"))
        label = "raw" if name == "raw" else "flywheel"
        print(f"{label:<10} {messages / pub:>14.0f} {mb / pub:>7.1f} {pub_cpu:>11.1f} "
              f"{messages / con:>14.0f} {mb / con:>7.1f} {con_cpu:>11.1f}")  # fmt: skip
    # Per-round ratios: raw and Flywheel ran back to back, under the same load.
    per_round = {
        k: statistics.median(r[f"raw_{k}"] / r[f"fly_{k}"] for r in results)
        for k in ("pub", "con", "pub_cpu", "con_cpu")
    }
    print(
        f"ratio flywheel/raw (of the median rounds): publish "
        f"{med['raw_pub'] / med['fly_pub']:.2f}x, consume {med['raw_con'] / med['fly_con']:.2f}x"
    )
    print(
        f"ratio flywheel/raw (median of per-round ratios): publish {per_round['pub']:.2f}x, "
        f"consume {per_round['con']:.2f}x; by CPU per message: publish "
        f"{per_round['pub_cpu']:.2f}x, consume {per_round['con_cpu']:.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--codec-seconds", type=float, default=3.0, help="Per token size.")
    args = p.parse_args()
    codec_bench(args.codec_seconds)
    with NatsServer() as server:
        asyncio.run(throughput(server.url, args.messages, args.tokens, args.rounds))


if __name__ == "__main__":
    main()

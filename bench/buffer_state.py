"""The buffer's state write per group: the old whole-state dump vs the new per-group record.

    .venv/bin/python bench/buffer_state.py [--g 32 512 2048 8192] [--reps 20]

For each G (groups per step), a state as a running buffer holds it: the
settled ids of the last `keep_settled_steps` = 8 batches and half a batch
pending (bench/results_fleet.md measured the old form this way). Per group:

- old (the baseline, measured in the same run): `dump_state` of that whole
  state (what services/buffer/app.py wrote after every group before issue
  #18), its packing time, and one KV put of it to an embedded nats-server;
  past NATS's max_payload the put fails, and that is printed.
- new: the one record a group's decision writes (`dump_accepted` under its
  `r.g.<id>` key), its packing time and KV put, plus the per-step writes
  (the batch key, the head) shared out over the step's G groups: bytes are
  key + value (the KV subject's `$KV.<bucket>.` prefix left out of both).

Times are medians over `--reps` of one process on shared cores: read the
ratios. Results go to bench/results_fleet.md by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.errors import MaxPayloadError

from services.buffer.core import BufferState, Cursor
from services.buffer.state import (
    HEAD_KEY,
    batch_key,
    dump_accepted,
    dump_batch,
    dump_head,
    dump_state,
    group_key,
)
from services.runtime.nats_conn import ensure_kv
from services.stack.localdev.nats_server import NatsServer

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

KEEP_STEPS = 8


def running_state(g: int) -> tuple[BufferState, list[tuple[str, int]]]:
    """8 steps of settled ids (one in eleven dropped) and half a batch pending."""
    settled: dict[str, tuple[int, str]] = {}
    i = 0
    for step in range(100, 100 + KEEP_STEPS):
        for _ in range(g + g // 10):
            verdict = "zero_variance" if i % 11 == 5 else "accepted"
            settled[f"bench:e0:i{i}:a0"] = (step, verdict)
            i += 1
    pending = [(f"bench:e0:i{i + j}:a0", 10 * i + j) for j in range(g // 2)]
    n = i + len(pending)
    step = 100 + KEEP_STEPS
    state = BufferState(Cursor(0, n + 64), n + 64, n, step, settled=settled, ready_version=step)
    return state, pending


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def median_put_ms(put: Callable[[], Awaitable[object]], reps: int) -> float | None:
    """Median ms of a KV put (None: it does not fit in a NATS message)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        try:
            await put()
        except MaxPayloadError:
            return None
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


@dataclass
class Row:
    g: int
    old_bytes: int
    old_pack_ms: float
    old_put_ms: float | None  # None: past max_payload
    new_bytes: float
    new_pack_ms: float
    new_put_ms: float
    step_ms: float  # the batch key and the head, once per step

    def __str__(self) -> str:
        new = self.new_pack_ms + self.new_put_ms + self.step_ms / self.g
        if self.old_put_ms is None:
            old_put = "fails: > max_payload"
            ratio = f"≥ {self.old_pack_ms / new:.1f}× (packing alone), and the put fails"
        else:
            old_put = f"{self.old_put_ms:.3f}"
            ratio = f"{(self.old_pack_ms + self.old_put_ms) / new:.1f}×"
        return (
            f"| {self.g:,} | {self.old_bytes:,} | {self.old_pack_ms:.3f} | {old_put} "
            f"| {self.new_bytes:.0f} | {self.new_pack_ms * 1e3:.1f} µs | {self.new_put_ms:.3f} "
            f"| {self.old_bytes / self.new_bytes:,.0f}× | {ratio} |"
        )


async def measure(g: int, kv: KeyValue, reps: int) -> Row:
    state, pending = running_state(g)
    old = dump_state(state, pending)
    gid, seq = pending[-1]
    record = dump_accepted(state.answered, seq)
    batch, head = dump_batch(1.0, [s for _, s in pending] * 2), dump_head(state, 0)
    step_writes = len(batch_key(1)) + len(batch) + len(HEAD_KEY) + len(head)
    new_put = await median_put_ms(lambda: kv.put(group_key(gid), record), reps)
    batch_put = await median_put_ms(lambda: kv.put(batch_key(1), batch), 3)
    head_put = await median_put_ms(lambda: kv.put(HEAD_KEY, head), 3)
    assert new_put is not None and batch_put is not None and head_put is not None
    return Row(
        g=g,
        old_bytes=len("state") + len(old),  # key + value, as on the wire
        old_pack_ms=median_ms(lambda: dump_state(state, pending), max(3, reps // 4)),
        old_put_ms=await median_put_ms(lambda: kv.put("state", old), max(3, reps // 4)),
        new_bytes=len(group_key(gid)) + len(record) + step_writes / g,
        new_pack_ms=median_ms(lambda: dump_accepted(state.answered, seq), reps * 50),
        new_put_ms=new_put,
        step_ms=batch_put + head_put,
    )


async def main(gs: list[int], reps: int) -> None:
    with NatsServer() as server:
        import nats

        nc = await nats.connect(server.url)
        kv = await ensure_kv(nc.jetstream(), "bench_buffer_state")
        print(f"max_payload {nc.max_payload:,} bytes; medians of {reps} (old: {max(3, reps // 4)})")
        print(
            "| G | old bytes/group | old pack ms | old put ms | new bytes/group (record + "
            "step share) | new pack | new put ms | bytes old/new | ms old/new (pack + put) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for g in gs:
            print(await measure(g, kv, reps), flush=True)
        await nc.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--g", type=int, nargs="+", default=[32, 512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    asyncio.run(main(args.g, args.reps))

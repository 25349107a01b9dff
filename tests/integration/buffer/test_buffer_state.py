"""The buffer's state across a restart, against a real nats-server, at a G where the
old whole-state write would not fit in a NATS message.

The real `BufferService` runs in this process (its handlers called as its
message loops call them; no dispatcher: the cursor is set, then stored by a
WeightsReady): ~10 steps of G = 512 groups go through `on_group`, some of
them dropped, one task dead-lettered; then a second service on the same
bucket restores, and must hold the same settled ids, pending groups (in
order), cursor and counters. The old form of the same state (one KV value)
is asserted to exceed max_payload (set to 64 KiB on this server). A second
test restores from the old form.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from prometheus_client import CollectorRegistry

from proto.codec import encode
from proto.messages import DeadLetter, PromptTask, SampleGroup, WeightsReady
from proto.streams import kv_bucket, streams_for
from proto.subjects import Subjects
from services.buffer.app import BufferService
from services.buffer.core import BufferState, Cursor
from services.buffer.settings import BufferSettings
from services.buffer.state import (
    HEAD_KEY,
    OUTBOX_KEY,
    STATE_KEY,
    BufferStateError,
    dump_outbox,
    dump_state,
)
from services.buffer.store import StateStore, read_entries
from services.runtime.errors import PermanentError
from services.runtime.nats_conn import ensure_kv, ensure_streams
from services.runtime.settings import load_settings
from services.stack.localdev.nats_server import NatsServer
from tests.harness.runfile import run_file
from tests.unit.buffer.test_core import group

RUN = "bufstate"


@dataclass
class Ctx:
    """What BufferService uses of a service context."""

    js: Any
    max_payload: int
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class At:
    """A delivery, as on_group reads it: the message's SAMPLES sequence."""

    stream_seq: int


def settings(tmp_path: Path, url: str, g: int) -> BufferSettings:
    path = tmp_path / "run.toml"
    buffer = {"groups_per_step": g, "max_staleness": 1000, "keep_settled_steps": 8,
              "keep_settled_s": 0.0}  # fmt: skip
    path.write_text(run_file(RUN, nats={"url": url}, task={"source": {"type": "arithmetic"}},
                             buffer=buffer))  # fmt: skip
    return load_settings(BufferSettings, path)


async def service(js: Any, max_payload: int, s: BufferSettings) -> BufferService:
    bucket = kv_bucket(RUN, "buffer")
    store = StateStore(js, await ensure_kv(js, bucket), bucket)
    svc = BufferService(Ctx(js, max_payload), s, store)  # type: ignore[arg-type]
    await svc.restore()
    return svc


async def feed(svc: BufferService, js: Any, groups: list[SampleGroup]) -> dict[str, int]:
    """Store the groups in SAMPLES (as rollout workers do), then decide each in order."""
    subject, seqs = Subjects(RUN).samples, {}
    for i in range(0, len(groups), 512):
        acks = await asyncio.gather(*(js.publish(subject, encode(g)) for g in groups[i : i + 512]))
        for g, ack in zip(groups[i : i + 512], acks, strict=True):
            seqs[g.group_id] = ack.seq
            try:
                await svc.on_group(g, At(ack.seq))  # type: ignore[arg-type]
            except PermanentError:
                pass  # dropped (zero variance): dead-lettered by the message loop
    return seqs


def snapshot(svc: BufferService) -> tuple[BufferState, list[tuple[str, int]]]:
    pending = [(g.group_id, svc.pending_seqs[g.group_id]) for g in svc.asm.pending]
    return svc.asm.state, pending


def test_a_restarted_buffer_recovers_its_state_past_max_payload(tmp_path: Path) -> None:
    # A 64 KiB max_payload (NATS's default is 1 MiB) puts the old form past it at
    # G = 512, an eighth of the groups (and of the run time) the default would take.
    with NatsServer(config="max_payload: 65536\n") as server:
        asyncio.run(asyncio.wait_for(_large(tmp_path, server.url, g=512, steps=10), 300))


async def _large(tmp_path: Path, url: str, g: int, steps: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    s = settings(tmp_path, url, g)
    svc = await service(js, nc.max_payload, s)
    n = steps * g + g // 2 + steps * g // 10  # every 11th group is dropped
    svc.asm.state.cursor, svc.asm.state.dispatched = Cursor(0, n + 7), n + 7
    await svc.on_ready(WeightsReady(run=RUN, version=3), None)  # type: ignore[arg-type]
    groups = [group(f"{RUN}:e0:i{i}:a0", 3, (1.0, 1.0) if i % 11 == 5 else (0.0, 1.0))
              for i in range(n)]  # fmt: skip
    started = time.monotonic()
    await feed(svc, js, groups)
    fed_s = time.monotonic() - started
    task = PromptTask(run=RUN, task_id=f"{RUN}:e0:i{n}", epoch=0, index=0, task_name="arithmetic",
                      prompt="1+1", answer="2", n=2, created_at=0.0)  # fmt: skip
    dead = DeadLetter(run=RUN, reason="max_deliver", error="", subject="t", service="rollout",
                      message_type=PromptTask.TYPE, payload=encode(task))  # fmt: skip
    await svc.on_dead_letter(dead, None)  # type: ignore[arg-type]
    before, pending = snapshot(svc)
    assert before.next_step == steps and len(pending) > g // 3
    assert min(s for s, _ in before.settled.values()) == steps - 8  # older ids forgotten
    assert f"{RUN}:e0:i{n}:a0" in before.settled
    old = dump_state(before, pending)
    assert len(old) > nc.max_payload, f"the old form fits ({len(old)} bytes): raise G"

    entries = await read_entries(svc.store.kv)
    records = [len(v) for k, (v, _) in entries.items() if k.startswith("r.g.")]
    assert max(records) < 64  # one small value per group
    assert len(records) <= len(before.settled) + len(pending) + g  # old steps purged
    after = await service(js, nc.max_payload, s)  # the restart
    assert after.asm.state == before
    assert snapshot(after)[1] == pending
    assert [g.group_id for g in after.asm.pending] == [gid for gid, _ in pending]
    await nc.close()
    print(f"G={g}: {n} groups decided in {fed_s:.1f} s; old form {len(old)} bytes")


@pytest.mark.parametrize("outbox", [False, True])
def test_a_buffer_restarting_on_the_old_form_writes_the_new_one(
    tmp_path: Path, outbox: bool
) -> None:
    with NatsServer() as server:
        asyncio.run(asyncio.wait_for(_old_form(tmp_path, server.url, outbox), 60))


async def _old_form(tmp_path: Path, url: str, outbox: bool) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    s = settings(tmp_path, url, g=4)
    svc = await service(js, nc.max_payload, s)
    svc.asm.state.cursor, svc.asm.state.dispatched = Cursor(0, 30), 30
    groups = [group(f"{RUN}:e0:i{i}:a0", 0, (1.0, 1.0) if i % 5 == 0 else (0.0, 1.0))
              for i in range(14)]  # fmt: skip
    seqs = await feed(svc, js, groups)
    before, pending = snapshot(svc)
    # What the old buffer kept: the whole state under one key (no outbox left: published).
    kv = svc.store.kv
    await js.purge_stream(svc.store.stream)
    await kv.put(STATE_KEY, dump_state(before, pending))
    if outbox:  # killed between storing the state and emptying the outbox of its last batch
        last = before.next_step - 1
        batch = [seqs[gid] for gid, v in before.settled.items() if v == (last, "accepted")]
        await kv.put(OUTBOX_KEY, dump_outbox([(last, 1.5, batch)]))
    after = await service(js, nc.max_payload, s)
    assert after.asm.state == before
    assert snapshot(after)[1] == pending
    keys = set(await read_entries(kv))
    assert HEAD_KEY in keys and STATE_KEY not in keys and "outbox" not in keys
    again = await service(js, nc.max_payload, s)  # and from the new form
    assert (again.asm.state, snapshot(again)[1]) == (before, pending)
    await nc.close()


def test_a_read_that_finds_nothing_over_stored_values_is_read_again() -> None:
    with NatsServer() as server:
        asyncio.run(asyncio.wait_for(_false_empty(server.url), 60))


async def _false_empty(url: str) -> None:
    """On a 3-server cluster just after a member restarted, a watcher once ended at
    once over 109 stored values (the chaos suite's cluster run). Here the first reads
    watch a key nothing has, so the real server gives the same empty answer."""
    nc = await nats.connect(url)
    kv = await ensure_kv(nc.jetstream(), kv_bucket(RUN, "buffer"))
    assert await read_entries(kv) == {}  # a new run: empty, and believed
    await kv.put("head", b"h")
    await kv.put("r.g.x", b"1")
    await kv.delete("r.g.x")  # a delete marker counts as seen, never as a value
    real, misses = kv.watchall, [2]

    async def watchall(**kw: Any) -> Any:
        if misses[0]:
            misses[0] -= 1
            return await kv.watch("no-such-key", **kw)
        return await real(**kw)

    kv.watchall = watchall  # type: ignore[method-assign]
    entries = await read_entries(kv)
    assert set(entries) == {"head"} and misses == [0]
    misses[0] = 1000
    with pytest.raises(BufferStateError, match="2 messages but 5 reads found none"):
        await read_entries(kv)
    await nc.close()

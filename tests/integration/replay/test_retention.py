"""How long a run stays replayable: `[nats] history_max_age_s` / `history_max_bytes`.

A service starting with those settings makes (or updates) the run's SAMPLES
and BATCHES streams with them; past `history_max_bytes` the server drops
the oldest batches, and reading the recording back then stops at the first
sequence gone (`RecordingTrimmed`), which is what `flywheel replay` reports.
Real nats-server, the runtime's own service start-up.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from proto.streams import DAY, stream_name
from proto.subjects import Subjects
from services.runtime.lifecycle import ServiceContext, run_service
from services.runtime.recording import RecordingTrimmed, recorded
from services.runtime.settings import NatsSettings, ServiceSettings
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import run_async


class Probe(ServiceSettings):
    section: ClassVar[str] = "probe"


def settings(url: str, **history: Any) -> Probe:
    return Probe(run="kept", nats=NatsSettings(url=url, connect_attempts=3, **history))


async def started(s: Probe, then: Any) -> None:
    """Start a service with `s` (it ensures the run's streams), run `then(ctx)`, stop."""

    async def body(ctx: ServiceContext) -> None:
        await then(ctx)

    await run_service("probe", s, body, handle_signals=False)


def test_the_history_settings_shape_samples_and_batches_and_a_restart_applies_new_ones(
    nats_server: NatsServer,
) -> None:
    seen: list[dict[str, Any]] = []

    async def look(ctx: ServiceContext) -> None:
        got = {}
        for what in ("SAMPLES", "BATCHES", "TASKS"):
            c = (await ctx.js.stream_info(stream_name("kept", what))).config
            got[what] = (round(c.max_age or 0), c.max_bytes)
        seen.append(got)

    run_async(started(settings(nats_server.url), look))
    forever = settings(nats_server.url, history_max_age_s=0, history_max_bytes=10**9)
    run_async(started(forever, look))
    assert seen[0]["BATCHES"] == seen[0]["SAMPLES"] == (7 * DAY, -1)
    assert seen[1]["BATCHES"] == seen[1]["SAMPLES"] == (0, 10**9)  # kept for ever, 1 GB each
    assert seen[0]["TASKS"] == seen[1]["TASKS"]  # the work queue is not history


def test_past_max_bytes_the_oldest_batches_go_and_reading_back_names_the_first(
    nats_server: NatsServer,
) -> None:
    stream = stream_name("kept", "BATCHES")

    async def fill(ctx: ServiceContext) -> None:
        for _ in range(20):  # 20 KB into a 4 KB stream
            await ctx.js.publish(Subjects("kept").batches, b"x" * 1000)
        info = (await ctx.js.stream_info(stream)).state
        assert info.first_seq > 1 and info.last_seq == 20
        with pytest.raises(RecordingTrimmed) as trimmed:
            async for _ in recorded(ctx.js, stream):
                pass
        assert trimmed.value.missing == 1 and trimmed.value.first == info.first_seq
        assert f"now starts at sequence {info.first_seq}" in str(trimmed.value)
        got = [seq async for seq, _ in recorded(ctx.js, stream, start_seq=info.first_seq)]
        assert got == list(range(info.first_seq, 21))  # from the head on: every one, in order

    run_async(started(settings(nats_server.url, history_max_bytes=4096), fill))

"""The recorded messages a replay reads: the run's batches and sample groups, decoded.

Read by sequence (services/runtime/recording.py), so a trimmed or holed
stream is a `RecordingTrimmed` naming the first sequence it lacks, never a
replay of less than was recorded. A message that does not decode is
counted and left out, as the services that read it live left it out (the
trainer and the buffer dead-letter it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proto.codec import decode
from proto.errors import ProtocolError
from proto.messages import SampleGroup, TrainBatch
from proto.streams import stream_name
from services.runtime.errors import ConfigError
from services.runtime.recording import extent, recorded


@dataclass
class Recording:
    """One stream's decoded messages, each with its stream sequence."""

    stream: str
    messages: list[tuple[int, Any]] = field(default_factory=list)
    undecodable: list[int] = field(default_factory=list)  # sequences left out


async def read(js: Any, run: str, what: str, cls: type[Any]) -> Recording:
    """Every `cls` message of the run's `what` stream ("BATCHES", "SAMPLES"), in order."""
    out = Recording(stream_name(run, what))
    async for seq, data in recorded(js, out.stream):
        try:
            out.messages.append((seq, decode(data, cls)))
        except ProtocolError:
            out.undecodable.append(seq)
    return out


async def batches(js: Any, run: str) -> Recording:
    """The run's TrainBatches; ConfigError when it recorded none."""
    rec = await read(js, run, "BATCHES", TrainBatch)
    if not rec.messages:
        ext = await extent(js, rec.stream, "reading a recorded run")
        raise ConfigError(
            f"run {run!r} recorded no batch (stream {rec.stream} holds {ext.messages} "
            "messages): nothing to replay"
        )
    return rec


async def sample_groups(js: Any, run: str) -> Recording:
    """The run's SampleGroups, every one the rollout workers published (trained or not)."""
    return await read(js, run, "SAMPLES", SampleGroup)


def trained_steps(rec: Recording) -> dict[str, int]:
    """group id -> the step whose batch trained it (the first, if a batch was re-published)."""
    out: dict[str, int] = {}
    for _, b in rec.messages:
        for g in b.groups:
            out.setdefault(g.group_id, b.step)
    return out

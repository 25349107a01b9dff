"""A run's recorded stream, read back by sequence: every message, in order, or a loud gap.

A run's SAMPLES and BATCHES streams keep history (limits retention,
proto/streams.py): what the buffer published is still there after the run
ended, and `flywheel replay` re-trains, re-scores or exports from it. A
replay is only worth its name if it reads *everything* the run recorded,
so this reader walks the stream's sequence numbers one by one (JetStream's
message get by sequence) from `start_seq` to the last sequence the stream
held when reading began, and stops at the first one the server no longer
has: trimmed by `max_age` / `max_bytes` (the head of the stream) or
deleted by hand (a hole), with `RecordingTrimmed` naming that sequence.
A consumer would skip such holes silently; a get by sequence cannot.

Chunked messages (proto/chunking.py: one message over max_payload sent in
parts) are put back together; a whole message is reported at the sequence
of its last part, as the trainer's checkpoint records it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proto.chunking import Reassembler
from services.runtime.errors import ConfigError
from services.runtime.missing import not_found_missing

KEEP_HISTORY = "[nats] history_max_age_s and history_max_bytes"
"""The settings that decide how long a run's recorded streams keep their messages."""


class RecordingTrimmed(ConfigError):
    """A recorded stream no longer holds a message a replay needs.

    A ConfigError: the cure is a setting (the streams' retention, for the
    next run), and a service stops on it with one line, not a traceback.
    """

    def __init__(self, stream: str, missing: int, first: int, last: int) -> None:
        self.stream, self.missing, self.first, self.last = stream, missing, first, last
        where = (
            f"the stream now starts at sequence {first}"
            if missing < first
            else f"sequence {missing} was deleted (the stream holds {first}..{last} with holes)"
        )
        super().__init__(
            f"stream {stream} is missing sequence {missing}: {where}. The run cannot be "
            f"replayed from there; a run stays replayable as long as its streams keep "
            f"every message ({KEEP_HISTORY})"
        )


@dataclass(frozen=True)
class Extent:
    """The sequences a stream holds now: `first..last` (`last < first` when empty)."""

    stream: str
    first: int
    last: int
    messages: int

    @property
    def holes(self) -> int:
        """Sequences between first and last the stream no longer has (deleted messages)."""
        return max(0, self.last - self.first + 1) - self.messages


async def extent(js: Any, stream: str, doing: str) -> Extent:
    """What `stream` holds now; JetStreamMissing (naming it) when it does not exist."""
    from nats.js.errors import NotFoundError

    try:
        info = await js.stream_info(stream)
    except NotFoundError as e:
        missing = not_found_missing(e, stream, doing)
        if missing is None:
            raise
        raise missing from e
    st = info.state
    return Extent(stream, int(st.first_seq), int(st.last_seq), int(st.messages))


async def recorded(
    js: Any, stream: str, *, start_seq: int = 1, end_seq: int | None = None
) -> AsyncIterator[tuple[int, bytes]]:
    """(sequence, whole message bytes) of `stream` from `start_seq` to `end_seq` (default:
    its last sequence now), in order; `RecordingTrimmed` at the first sequence it lacks."""
    from nats.js.errors import NotFoundError

    ext = await extent(js, stream, "reading a recorded run")
    end = ext.last if end_seq is None else end_seq
    reassembler = Reassembler()
    for seq in range(max(1, start_seq), end + 1):
        try:
            msg = await js.get_msg(stream, seq)
        except NotFoundError as e:
            now = await extent(js, stream, "reading a recorded run")
            raise RecordingTrimmed(stream, seq, now.first, now.last) from e
        whole = reassembler.feed(msg.data or b"")
        if whole is not None:
            yield seq, whole

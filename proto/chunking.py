"""Split an oversized encoded message into Chunks, and reassemble them.

No message may exceed NATS's max_payload (1 MiB by default), yet a
32k-token sample group or a batch of hundreds of samples is larger. The
sender encodes the whole message once, cuts the bytes into `Chunk`
messages that each fit, and publishes them in order on the same subject
with ids `<message id>:c<index>` (so JetStream de-duplicates a resend).
The reader feeds every message to a `Reassembler`: a non-chunk passes
through, chunks are held until all `count` parts of one `of` id arrived,
then the joined bytes are checked against `sha256` and decoded as usual.

Pure: no NATS here. The reader acks the chunks only once the whole
message was handled, so a crash mid-message redelivers all its parts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from proto.codec import decode, encode, peek_type
from proto.errors import MalformedMessage, ProtocolError
from proto.messages import Chunk

# A Chunk's own fields (ids, sizes, sha256, framing) take well under this.
CHUNK_OVERHEAD = 1024


def split(data: bytes, message_id: str, max_payload: int) -> list[bytes]:
    """Encoded Chunk messages, each ≤ max_payload, that together carry `data`.

    If `data` already fits, returns `[data]` unchanged.
    """
    if len(data) <= max_payload:
        return [data]
    if max_payload <= CHUNK_OVERHEAD * 2:
        raise ValueError(f"max_payload {max_payload} is too small to chunk into")
    step = max_payload - CHUNK_OVERHEAD - len(message_id)
    digest = hashlib.sha256(data).hexdigest()
    parts = [data[i : i + step] for i in range(0, len(data), step)]
    return [
        encode(
            Chunk(
                of=message_id,
                index=i,
                count=len(parts),
                total_size=len(data),
                sha256=digest,
                data=part,
            ),
            max_payload,
        )
        for i, part in enumerate(parts)
    ]


@dataclass
class _Partial:
    count: int
    total_size: int
    sha256: str
    parts: dict[int, bytes] = field(default_factory=dict)


class Reassembler:
    """Collects chunks; `feed` returns whole message bytes once complete, else None."""

    def __init__(self, remember: int = 1024) -> None:
        self._pending: dict[str, _Partial] = {}
        # Ids completed recently: a late redelivered part of one of them is a
        # stray duplicate, not the start of a message that will never finish.
        self._done: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    @property
    def pending(self) -> int:
        """Messages with some but not all parts received."""
        return len(self._pending)

    def feed(self, data: bytes) -> bytes | None:
        if peek_type(data) != Chunk.TYPE:
            return data
        chunk = decode(data, Chunk)
        if chunk.of in self._done:
            return None
        p = self._pending.setdefault(
            chunk.of, _Partial(chunk.count, chunk.total_size, chunk.sha256)
        )
        if (p.count, p.total_size, p.sha256) != (chunk.count, chunk.total_size, chunk.sha256):
            del self._pending[chunk.of]
            raise MalformedMessage(
                "chunk header disagrees with earlier parts", message_type="Chunk", field="of"
            )
        p.parts[chunk.index] = chunk.data  # a redelivered part simply overwrites
        if len(p.parts) < p.count:
            return None
        del self._pending[chunk.of]
        self._done[chunk.of] = None
        if len(self._done) > self._remember:
            self._done.popitem(last=False)
        whole = b"".join(p.parts[i] for i in range(p.count))
        if len(whole) != p.total_size or hashlib.sha256(whole).hexdigest() != p.sha256:
            raise ProtocolError(
                "reassembled bytes fail size/sha256 check", message_type="Chunk", field="sha256"
            )
        return whole

    def discard(self, message_id: str) -> None:
        """Forget a message entirely, e.g. when handling it failed and all its
        parts will be redelivered and must be reassembled again."""
        self._pending.pop(message_id, None)
        self._done.pop(message_id, None)

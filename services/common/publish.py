"""Publish a message to JetStream: encoded, de-duplicated, chunked if it must be.

The one way services publish proto messages, so every message gets its
deterministic `Nats-Msg-Id` (a resend after a crash is stored once) and a
message over `max_payload` travels as chunks (proto/chunking.py) instead of
failing or being dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proto.chunking import split
from proto.codec import encode, message_id
from proto.errors import MessageTooLarge

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from proto.messages import Message


async def publish(js: JetStreamContext, subject: str, msg: Message, max_payload: int) -> int:
    """Publish `msg` on `subject`; returns the number of NATS messages it took."""
    data = encode(msg, max_payload=None)
    mid = message_id(msg)
    if len(data) <= max_payload:
        await js.publish(subject, data, headers={"Nats-Msg-Id": mid} if mid else None)
        return 1
    if mid is None:  # only de-duplicated messages may be chunked (ids name the parts)
        raise MessageTooLarge(len(data), max_payload, message_type=msg.TYPE)
    parts = split(data, mid, max_payload)
    for i, part in enumerate(parts):
        await js.publish(subject, part, headers={"Nats-Msg-Id": f"{mid}:c{i}"})
    return len(parts)

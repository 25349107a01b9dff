"""Publish a message to JetStream: encoded, de-duplicated, chunked if it must be.

The one way services publish proto messages, so every message gets its
deterministic `Nats-Msg-Id` (a resend after a crash is stored once) and a
message over `max_payload` travels as chunks (proto/chunking.py) instead of
failing or being dropped.

A publish that meets a nats-server on its way back (restarted, or
JetStream still recovering its streams: no responders, no stream response,
timeouts) is retried with backoff for up to `RETRY_S` before the error is
raised: the chaos suite restarts the server under a running stack, and a
service must ride that out rather than crash. The ids make a retry of a
publish that was in fact stored harmless. No answer at all may also mean
the subject's stream is gone: then the server is asked, and a stream it
confirms missing stops the service (`JetStreamMissing`, missing.py) instead
of a retry that cannot end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from proto.chunking import split
from proto.codec import encode, message_id
from proto.errors import MessageTooLarge

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from proto.messages import Message


log = logging.getLogger(__name__)

RETRY_S = 30.0
"""How long a publish keeps retrying a server that is down or coming back."""


async def _publish(js: JetStreamContext, subject: str, data: bytes, mid: str | None) -> None:
    from services.runtime.missing import no_answer_errors, raise_if_subject_unstored
    from services.runtime.msgloop import transient_errors

    transient, no_answer = transient_errors(), no_answer_errors()
    deadline = time.monotonic() + RETRY_S
    delay = 0.05
    while True:
        try:
            await js.publish(subject, data, headers={"Nats-Msg-Id": mid} if mid else None)
            return
        except transient as e:
            if isinstance(e, no_answer):
                await raise_if_subject_unstored(js, subject, f"publishing to {subject}")
            if time.monotonic() + delay > deadline:
                raise
            log.warning("publish to %s failed (%r); retrying in %.2fs", subject, e, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)


async def publish(js: JetStreamContext, subject: str, msg: Message, max_payload: int) -> int:
    """Publish `msg` on `subject`; returns the number of NATS messages it took."""
    data = encode(msg, max_payload=None)
    mid = message_id(msg)
    if len(data) <= max_payload:
        await _publish(js, subject, data, mid)
        return 1
    if mid is None:  # only de-duplicated messages may be chunked (ids name the parts)
        raise MessageTooLarge(len(data), max_payload, message_type=msg.TYPE)
    parts = split(data, mid, max_payload)
    for i, part in enumerate(parts):
        await _publish(js, subject, part, f"{mid}:c{i}")
    return len(parts)

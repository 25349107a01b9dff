"""A stream, KV bucket or consumer that is gone: told apart from a server that is away.

JetStream answers a publish to a subject no stream takes, a fetch from a
consumer that does not exist, and a KV write to a deleted bucket the same
way it answers while it restarts or elects a leader: no responders (nats-py:
`NoStreamResponseError`, `ServiceUnavailableError`). Retrying the first kind
never ends (the buffer used to warn about it every round, forever). So after
such an answer the caller asks the JetStream API about the stream (and the
consumer): "not found" (10059 stream, 10014 consumer) from a server that
answers is the truth, and is asked `CONFIRM_TIMES` times over about a second
so that a server half-way through a restart cannot stop a service;
`JetStreamMissing` then stops the service, naming what is missing. Any other
answer (or none: NATS away) leaves the caller to retry as before.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from proto.streams import stream_of
from services.runtime.errors import JetStreamMissing

if TYPE_CHECKING:
    from nats.js import JetStreamContext

JS_STREAM_NOT_FOUND = 10059
JS_CONSUMER_NOT_FOUND = 10014
CONFIRM_TIMES = 3
CONFIRM_PAUSE_S = 0.5


@functools.cache
def no_answer_errors() -> tuple[type[BaseException], ...]:
    """What nats-py raises when nothing answers a JetStream subject (a missing stream too)."""
    from nats.errors import NoRespondersError
    from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

    return (NoRespondersError, NoStreamResponseError, ServiceUnavailableError)


def described(stream: str) -> tuple[str, str]:
    """(kind, name) of a stream as a user knows it: a KV bucket's stream by its bucket."""
    if stream.startswith("KV_"):
        return "KV bucket", stream.removeprefix("KV_")
    return "stream", stream


def not_found_missing(e: BaseException, stream: str, doing: str) -> JetStreamMissing | None:
    """The JetStreamMissing a "not found" answer about `stream` means, or None."""
    if getattr(e, "err_code", None) == JS_STREAM_NOT_FOUND:
        return JetStreamMissing(*described(stream), doing)
    return None


async def _lookup(js: JetStreamContext, stream: str, consumer: str | None) -> int | None:
    """The API's not-found code for the stream/consumer; None when it is there or no answer."""
    from nats.errors import Error as NatsError
    from nats.js.errors import NotFoundError

    try:
        if consumer is None:
            await js.stream_info(stream)
        else:
            await js.consumer_info(stream, consumer)
    except NotFoundError as e:
        return e.err_code
    except (NatsError, TimeoutError, OSError):
        return None  # cannot tell now: the caller retries as it did
    return None


async def raise_if_missing(
    js: JetStreamContext, stream: str | None, doing: str, *, consumer: str | None = None
) -> None:
    """Raise JetStreamMissing if the server confirms `stream` (or its `consumer`) is gone."""
    if stream is None:
        return
    code: int | None = None
    for i in range(CONFIRM_TIMES):
        if i:
            await asyncio.sleep(CONFIRM_PAUSE_S * i)
        code = await _lookup(js, stream, consumer)
        if code not in (JS_STREAM_NOT_FOUND, JS_CONSUMER_NOT_FOUND):
            return
    if code == JS_CONSUMER_NOT_FOUND and consumer is not None:
        raise JetStreamMissing("consumer", f"{stream}/{consumer}", doing)
    raise JetStreamMissing(*described(stream), doing)


async def raise_if_subject_unstored(js: JetStreamContext, subject: str, doing: str) -> None:
    """After no stream answered a publish to `subject`: stop if its stream is gone."""
    await raise_if_missing(js, stream_of(subject), doing)

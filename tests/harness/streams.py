"""A run's JetStream streams read as an operator would: a plain NATS client, no service code.

Synchronous (each call runs its own event loop), for tests that poll from
plain code; chunked messages are joined (proto/chunking.py).
"""

from __future__ import annotations

import asyncio


def read_stream(nats_url: str, stream: str, subject: str) -> list[bytes]:
    """Every message body on `subject` in `stream`, in order (chunked messages joined)."""
    return asyncio.run(read_stream_async(nats_url, stream, subject))


async def read_stream_async(nats_url: str, stream: str, subject: str) -> list[bytes]:
    import nats
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from proto.chunking import Reassembler

    nc = await nats.connect(nats_url.split(","))  # a cluster: every member's URL
    try:
        # The API's default 5 s ran out once for stream_info under make test's load (a
        # stack's services and three other workers' beside the server): a reader waits.
        js = nc.jetstream(timeout=30)
        info = await js.stream_info(stream, subjects_filter=subject)
        want = sum((info.state.subjects or {}).values())
        cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                             inactive_threshold=10.0)  # fmt: skip
        sub = await js.pull_subscribe(subject, durable=None, stream=stream, config=cfg)
        r = Reassembler()
        out: list[bytes] = []
        seen = 0
        while seen < want:
            try:
                msgs = await sub.fetch(min(256, want - seen), timeout=5)
            except NatsTimeout:
                break
            for m in msgs:
                seen += 1
                whole = r.feed(m.data)
                if whole is not None:
                    out.append(whole)
        await sub.unsubscribe()
        return out
    finally:
        await nc.close()


def messages(nats_url: str, run: str, what: str, subject: str, cls: type) -> list:
    """Every `cls` message on `subject` of the run's `what` stream (e.g. "BATCHES"), decoded."""
    from proto.codec import decode
    from proto.streams import stream_name

    return [decode(b, cls) for b in read_stream(nats_url, stream_name(run, what), subject)]


def published_versions(nats_url: str, run: str) -> dict:
    """Every WeightsPublished of the run, by version."""
    from proto.messages import WeightsPublished
    from proto.subjects import Subjects

    msgs = messages(nats_url, run, "WEIGHTS", Subjects(run).weights_published, WeightsPublished)
    return {m.version: m for m in msgs}


def publish_raw(nats_url: str, subject: str, datas: list[bytes]) -> None:
    """Publish bytes as they are (bad input included) to a JetStream subject."""

    async def body() -> None:
        import nats

        nc = await nats.connect(nats_url.split(","))  # a cluster: every member's URL
        try:
            js = nc.jetstream()
            for d in datas:
                await js.publish(subject, d, timeout=10)
        finally:
            await nc.close()

    asyncio.run(body())

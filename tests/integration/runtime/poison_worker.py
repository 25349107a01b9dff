"""A service whose handler hangs on every message (as one that crashes on it would).

Run as `python -m tests.integration.runtime.poison_worker <nats url> <run>`: consumes the run's
`buffer` consumer (max_deliver 2, ack_wait 1 s) with the real MessageLoop,
printing `delivered <n>` for each delivery, until killed or SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys

from prometheus_client import CollectorRegistry

from proto.messages import SampleGroup
from proto.streams import ConsumerSpec, consumers_for
from services.runtime.msgloop import Delivery, MessageLoop
from services.runtime.nats_conn import connect
from services.runtime.settings import NatsSettings


def poison_consumer(run: str) -> ConsumerSpec:
    return dataclasses.replace(consumers_for(run)["buffer"], ack_wait_s=1.0, max_deliver=2)


async def main(url: str, run: str) -> None:
    nc = await connect(NatsSettings(url=url, connect_attempts=3), "poison-worker")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def hang(group: SampleGroup, d: Delivery) -> None:
        print(f"delivered {d.delivered}", flush=True)
        await stop.wait()

    loop = MessageLoop(
        nc.jetstream(), poison_consumer(run), SampleGroup, hang, run=run, service="buffer",
        registry=CollectorRegistry(), max_payload=1 << 20, concurrency=4, heartbeat_s=0,
        fetch_timeout_s=0.2, nc=nc,
    )  # fmt: skip
    print("consuming", flush=True)
    try:
        await loop.run(stop)
    finally:
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))

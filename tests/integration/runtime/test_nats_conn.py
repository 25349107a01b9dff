"""connect + ensure_streams / ensure_consumer against a real nats-server."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from proto.codec import decode
from proto.streams import consumers_for, stream_name, streams_for
from services.runtime.nats_conn import (
    NatsConnectError,
    StreamConfigError,
    connect,
    ensure_consumer,
    ensure_streams,
    server_max_payload,
)
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer


def test_ensure_streams_is_idempotent_and_applies_changes(nats_settings, run_async):
    async def body():
        nc = await connect(nats_settings, "test")
        try:
            js = nc.jetstream()
            specs = streams_for("r1")
            first = await ensure_streams(js, specs)
            assert [e.action for e in first] == ["created"] * len(specs)
            second = await ensure_streams(js, specs)
            assert [e.action for e in second] == ["unchanged"] * len(specs)

            changed = dataclasses.replace(specs[1], max_age_s=3600.0, duplicate_window_s=120.0)
            (e,) = await ensure_streams(js, [changed])
            assert e.action == "updated"
            assert set(e.diff) == {"max_age", "duplicate_window"}
            info = await js.stream_info(changed.name)
            assert info.config.max_age == pytest.approx(3600.0)
            assert info.config.duplicate_window == pytest.approx(120.0)
            (again,) = await ensure_streams(js, [changed])
            assert again.action == "unchanged"

            # Storage cannot change in place: a typed error naming the field.
            with pytest.raises(StreamConfigError) as err:
                await ensure_streams(js, [dataclasses.replace(changed, storage="memory")])
            assert "storage" in err.value.diff

            for spec in consumers_for("r1").values():
                assert (await ensure_consumer(js, spec)).action == "created"
                assert (await ensure_consumer(js, spec)).action == "unchanged"
            rollout = consumers_for("r1")["rollout"]
            upd = await ensure_consumer(js, dataclasses.replace(rollout, ack_wait_s=5.0))
            assert upd.action == "updated" and set(upd.diff) == {"ack_wait"}
            info = await js.consumer_info(rollout.stream, rollout.durable)
            assert info.config.ack_wait == pytest.approx(5.0)

            assert server_max_payload(nc) == 1024 * 1024
            assert server_max_payload(nc, 1000) == 1000
        finally:
            await nc.close()

    run_async(body())


def test_connect_retries_until_server_appears(run_async, eventually, caplog):
    server = NatsServer()
    server.start()
    url = server.url
    server.stop()  # the port is known but nobody listens: the first attempts fail

    async def body():
        import asyncio

        settings = NatsSettings(url=url, connect_attempts=20)
        connecting = asyncio.create_task(connect(settings, "late"))
        # the server appears only after an attempt has failed
        await eventually(lambda: "connect attempt 1/20" in caplog.text)
        await asyncio.to_thread(server.start)
        nc = await connecting
        try:
            assert nc.is_connected
        finally:
            await nc.close()

    caplog.set_level("WARNING", logger="services.runtime.nats_conn")
    try:
        run_async(body())
    finally:
        server.close()


def test_connect_gives_up_with_typed_error(run_async):
    server = NatsServer()
    server.start()
    url = server.url
    server.close()

    with pytest.raises(NatsConnectError) as err:
        run_async(connect(NatsSettings(url=url, connect_attempts=2, connect_timeout_s=1), "x"))
    assert err.value.attempts == 2 and err.value.url == url


def test_connect_with_user_password(run_async):
    conf = 'authorization { user: "svc", password: "s3cret" }\n'
    with NatsServer(config=conf) as server:

        async def ok():
            nc = await connect(
                NatsSettings(url=server.url, user="svc", password="s3cret", connect_attempts=1),
                "auth",
            )
            await nc.close()

        run_async(ok())
        with pytest.raises(NatsConnectError, match="refused the credentials"):
            run_async(
                connect(
                    NatsSettings(url=server.url, user="svc", password="bad", connect_attempts=5),
                    "auth",
                )
            )


def test_connect_with_token(run_async):
    with NatsServer(config='authorization { token: "t0ken" }\n') as server:

        async def ok() -> bool:
            nc = await connect(
                NatsSettings(url=server.url, token="t0ken", connect_attempts=1), "tok"
            )
            try:
                return bool(nc.is_connected)
            finally:
                await nc.close()

        assert run_async(ok())
        with pytest.raises(NatsConnectError, match="refused the credentials"):
            run_async(connect(NatsSettings(url=server.url, token="nope", connect_attempts=5), "t"))


def test_publish_rides_out_a_server_restart(tmp_path, run_async):
    """A publish issued while nats-server is down is stored once it is back, not raised."""
    import threading

    from proto.examples import EXAMPLES
    from proto.messages import WeightsReady
    from proto.subjects import Subjects
    from services.runtime.publish import publish

    ready = EXAMPLES["WeightsReady"]
    assert isinstance(ready, WeightsReady)
    subject = Subjects(ready.run).weights_ready

    async def body() -> None:
        with NatsServer(store_dir=tmp_path / "store") as server:
            nc = await connect(NatsSettings(url=server.url, connect_attempts=1), "pub")
            js = nc.jetstream()
            await ensure_streams(js, streams_for(ready.run))
            server.stop()
            back = threading.Timer(1.5, server.start)  # the server returns while we publish
            back.start()
            try:
                assert await publish(js, subject, ready, nc.max_payload) == 1
            finally:
                back.join()
            got = await js.get_last_msg(stream_name(ready.run, "WEIGHTS"), subject)
            assert decode(got.data, WeightsReady) == ready
            await nc.close()

    run_async(body())


def test_a_lost_server_is_a_warning_a_drain_is_not(run_async, caplog):
    """The console of `flywheel up` shows services' warnings: a service that drains its own
    connection on the way out must not warn "disconnected", a lost server must."""
    import logging

    def disconnects() -> list[int]:
        return [r.levelno for r in caplog.records if r.getMessage() == "nats[q]: disconnected"]

    async def body() -> tuple[list[int], list[int]]:
        with NatsServer() as server:
            nc = await connect(NatsSettings(url=server.url, connect_attempts=1), "q")
            await nc.drain()
            drained = disconnects()
            caplog.clear()
            nc = await connect(NatsSettings(url=server.url, connect_attempts=1), "q")
            server.stop()
            for _ in range(100):  # nats-py notices the lost socket in its read loop
                if disconnects():
                    break
                await asyncio.sleep(0.05)
            lost = disconnects()
            await nc.close()
            return drained, lost

    with caplog.at_level(logging.INFO, logger="services.runtime.nats_conn"):
        drained, lost = run_async(body())
    assert drained == [logging.INFO]
    assert lost[:1] == [logging.WARNING]

"""Replicated streams on a real 3-server JetStream cluster, and the loss of a server.

- Everything Flywheel creates (proto's streams, the consumers on them, the
  buffer's KV bucket), through the code paths the services run, has
  `[nats] replicas` replicas; streams made with another count are scaled.
- kill -9 of the server leading a stream while messages are published and
  consumed through the product's publish() and MessageLoop: the other two
  carry on, no acknowledged message is lost or stored twice, and the killed
  server, restarted, rejoins with every message.
- replicas > 1 on a single server is a ReplicasError naming the setting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from proto.examples import EXAMPLES
from proto.messages import SampleGroup
from proto.streams import consumers_for, kv_bucket, stream_name, streams_for
from proto.subjects import Subjects
from services.buffer.store import open_kv
from services.runtime.errors import ConfigError, NatsServerError
from services.runtime.lifecycle import ServiceContext, run_service
from services.runtime.msgloop import Delivery, MessageLoop
from services.runtime.nats_conn import (
    ReplicasError,
    connect,
    ensure_consumer,
    ensure_kv,
    ensure_streams,
    server_max_payload,
)
from services.runtime.settings import NatsSettings, ServiceSettings
from services.stack.localdev import nats_jsz, ports
from services.stack.localdev.nats_cluster import NatsCluster
from tests.harness import REPO


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    with NatsCluster(3) as c:
        yield c


def settings(url: str, run: str, replicas: int, attempts: int = 3) -> ServiceSettings:
    return ServiceSettings(
        run=run, nats=NatsSettings(url=url, connect_attempts=attempts, replicas=replicas)
    )


# what a service starting beside its servers waits for them (0.1 s doubling to 5 s)
SERVICE_ATTEMPTS = NatsSettings.model_fields["connect_attempts"].default


async def set_up_like_the_services(s: ServiceSettings) -> None:
    """run_service (streams) + every durable consumer + the buffer's KV bucket."""

    async def body(ctx: ServiceContext) -> None:
        for spec in consumers_for(s.run).values():
            await ensure_consumer(ctx.js, spec)
        await open_kv(ctx, s.run)

    await run_service("setup", s, body, handle_signals=False)


def test_every_stream_bucket_and_consumer_has_the_configured_replicas(cluster, run_async):
    run = "r3"

    async def body() -> None:
        await set_up_like_the_services(settings(cluster.url, run, 3))
        nc = await connect(NatsSettings(url=cluster.url, connect_attempts=3), "check")
        try:
            js = nc.jetstream()
            infos = {i.config.name: i for i in await js.streams_info()}
            ours = {n for n in infos if n.startswith(f"FLYWHEEL_{run}_") or run in n}
            expected = {spec.name for spec in streams_for(run)} | {f"KV_{kv_bucket(run, 'buffer')}"}
            assert ours == expected
            for name in expected:
                info = infos[name]
                assert info.config.num_replicas == 3, name
                # the leader plus two followers, on three different servers
                assert info.cluster is not None and info.cluster.leader, name
                peers = {info.cluster.leader} | {p.name for p in info.cluster.replicas or []}
                assert peers == set(cluster.names), (name, peers)
            for spec in consumers_for(run).values():
                c = await js.consumer_info(spec.stream, spec.durable)
                assert c.cluster is not None and len(c.cluster.replicas or []) == 2, spec.durable
        finally:
            await nc.close()

    run_async(body())


def test_streams_and_buckets_made_with_one_replica_are_scaled_to_three(cluster, run_async):
    run = "grow"

    async def body() -> None:
        nc = await connect(NatsSettings(url=cluster.url, connect_attempts=3), "grow")
        try:
            js = nc.jetstream()
            specs = streams_for(run)
            assert {e.action for e in await ensure_streams(js, specs)} == {"created"}
            await js.publish(Subjects(run).samples, b"kept")
            await ensure_kv(js, kv_bucket(run, "buffer"))
            scaled = await ensure_streams(js, specs, replicas=3)
            assert {e.action for e in scaled} == {"updated"}
            assert all(e.diff == {"num_replicas": (3, 1)} for e in scaled)
            kv = await ensure_kv(js, kv_bucket(run, "buffer"), replicas=3)
            await kv.put("k", b"v")
            for name in [s.name for s in specs] + [f"KV_{kv_bucket(run, 'buffer')}"]:
                assert (await js.stream_info(name)).config.num_replicas == 3, name
            info = await js.stream_info(stream_name(run, "SAMPLES"))
            assert info.state.messages == 1  # scaling kept the stream's messages
            again = await ensure_streams(js, specs, replicas=3)
            assert {e.action for e in again} == {"unchanged"}
        finally:
            await nc.close()

    run_async(body())


def test_more_replicas_than_servers_is_a_config_error(cluster, run_async):
    async def body() -> None:
        with pytest.raises(ReplicasError, match=r"\[nats\] replicas = 5: .*fewer than 5 servers"):
            await set_up_like_the_services(settings(cluster.url, "five", 5))

    run_async(body())


def group(run: str, i: int) -> SampleGroup:
    g = EXAMPLES["SampleGroup"]
    assert isinstance(g, SampleGroup)
    return g.model_copy(update={"run": run, "group_id": f"{run}:g{i}"})


async def _lose_the_stream_leader(cluster: NatsCluster, run: str) -> dict[str, float]:
    """Publish and consume through a kill -9 of SAMPLES' leader; returns timings."""
    from services.runtime.publish import publish

    nc = await connect(NatsSettings(url=cluster.url, connect_attempts=3), "survivor")
    js = nc.jetstream()
    stream = stream_name(run, "SAMPLES")
    await ensure_streams(js, streams_for(run), replicas=3)
    # A short ack wait: a delivery lost with the dead server comes back soon.
    consumer = dataclasses.replace(consumers_for(run)["buffer"], ack_wait_s=3)
    await ensure_consumer(js, consumer)
    handled: set[str] = set()
    acked: list[str] = []

    async def handle(g: SampleGroup, d: Delivery) -> None:
        handled.add(g.group_id)

    loop = MessageLoop(
        js,
        consumer,
        SampleGroup,
        handle,
        run=run,
        service="survivor",
        registry=CollectorRegistry(),
        max_payload=server_max_payload(nc),
        fetch_timeout_s=0.2,
    )
    stop = asyncio.Event()
    consuming = asyncio.create_task(loop.run(stop))

    async def produce(numbers: range) -> None:
        for i in numbers:
            g = group(run, i)
            await publish(js, Subjects(run).samples, g, server_max_payload(nc))
            acked.append(g.group_id)  # publish returned: JetStream acknowledged it

    try:
        await produce(range(20))
        leader = await asyncio.to_thread(cluster.wait_stream_leader, stream)
        ports = (leader.port, leader.monitor_port, leader.cluster)
        await asyncio.to_thread(cluster.kill, leader)
        killed_at = time.monotonic()
        await produce(range(20, 40))  # through the election of a new leader
        publish_resumed_s = time.monotonic() - killed_at
        new_leader = await asyncio.to_thread(cluster.wait_stream_leader, stream)
        assert new_leader is not leader and not leader.running

        async def all_handled() -> bool:
            return handled >= set(acked)

        await _until(all_handled, 30)
        info = await js.stream_info(stream)
        assert info.state.messages == len(acked) == 40  # none lost, none stored twice

        restarted_at = time.monotonic()
        await asyncio.to_thread(cluster.start_node, leader)  # ready = rejoined and current
        rejoin_s = time.monotonic() - restarted_at
        assert (leader.port, leader.monitor_port, leader.cluster) == ports  # same addresses

        async def caught_up() -> bool:
            return _local_messages(cluster, leader.server_name or "", stream) == 40

        await _until(caught_up, 15)
        await produce(range(40, 45))  # the three of them again
        await _until(all_handled, 15)
        assert handled == set(acked) and len(acked) == 45
    finally:
        stop.set()
        await consuming
        await nc.close()
    return {"publish_resumed_s": publish_resumed_s, "rejoin_s": rejoin_s}


def _local_messages(cluster: NatsCluster, node: str, stream: str) -> int | None:
    """Messages in `node`'s own replica of `stream` (its /jsz), None if it has none."""
    return nats_jsz.stream_messages(cluster.jsz(node, "streams=true"), stream)


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"{check.__name__} not true within {timeout_s}s")
        await asyncio.sleep(0.05)


@pytest.mark.slow  # a 3-server cluster of its own, restarted under load
def test_kill_9_of_the_stream_leader_loses_no_acknowledged_message(tmp_path, run_async):
    with NatsCluster(3, store_root=tmp_path) as cluster:
        timings = run_async(_lose_the_stream_leader(cluster, "chaos"), timeout_s=120)
        assert cluster.running and cluster.wait_meta_leader() is not None
    print(f"cluster kill -9 of the stream leader: {timings}")


def test_replicas_above_one_on_a_single_server_is_a_config_error(nats_server, run_async):
    async def body() -> None:
        with pytest.raises(ReplicasError) as err:
            await set_up_like_the_services(settings(nats_server.url, "solo", 3))
        assert isinstance(err.value, ConfigError)  # services exit 2 with the message
        message = str(err.value)
        assert "[nats] replicas = 3" in message and "not clustered" in message
        assert "replicas = 1" in message

        nc = await connect(NatsSettings(url=nats_server.url, connect_attempts=3), "solo")
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for("solo"))  # R1 is fine
            with pytest.raises(ReplicasError, match=r"\[nats\] replicas = 3") as up:
                await ensure_streams(js, streams_for("solo"), replicas=3)
            assert up.value.diff == {"num_replicas": (3, 1)}
            with pytest.raises(ReplicasError, match="KV bucket"):
                await ensure_kv(js, kv_bucket("solo", "buffer"), replicas=3)
        finally:
            await nc.close()

    run_async(body())


def test_a_taken_route_port_starts_the_cluster_again_on_others(monkeypatch):
    """The probe-then-bind race of route ports, forced: the first probe names
    a port someone else holds."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    real = ports.free_port
    handed = iter([taken])
    monkeypatch.setattr(
        ports,
        "free_port",
        lambda host="127.0.0.1": next(handed, None) or real(host),
    )
    try:
        with NatsCluster(3) as c:
            assert c.running
            assert all(n.cluster is not None and n.cluster.port != taken for n in c.nodes)
    finally:
        holder.close()


def test_members_are_found_by_index_name_or_themselves(cluster):
    n1 = cluster.node(1)
    assert cluster.node("nats-1") is n1 and cluster.node(n1) is n1
    assert re.fullmatch(r"(nats://127\.0\.0\.1:\d+,){2}nats://127\.0\.0\.1:\d+", cluster.url)
    with pytest.raises(NatsServerError, match="no member named 'x'"):
        cluster.node("x")
    with pytest.raises(NatsServerError, match="2 given for 3 servers"):
        NatsCluster(3, ports=[1, 2])


def test_flywheel_nats_cluster_3_serves_replicated_streams_until_sigterm(tmp_path, run_async):
    store = tmp_path / "store"
    args = ["--cluster", "3", "--port", "0", "--monitor-port", "0", "--cluster-port", "0"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.stack.localdev.nats_cli",
            *args,
            "--store-dir",
            str(store),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(4)]  # blocks until ready (or died)
        assert lines[0].startswith("NATS cluster of 3 ready"), lines
        assert lines[1:] == ["[nats]\n", lines[2], "replicas = 3\n"], lines
        url = lines[2].removeprefix('url = "').rstrip().removesuffix('"')
        assert len(url.split(",")) == 3

        async def replicated() -> int:
            nc = await connect(NatsSettings(url=url, connect_attempts=3), "cli")
            try:
                js = nc.jetstream()
                await ensure_streams(js, streams_for("cli")[:1], replicas=3)
                info = await js.stream_info(streams_for("cli")[0].name)
                return len(info.cluster.replicas or []) + 1 if info.cluster else 1
            finally:
                await nc.close()

        assert run_async(replicated()) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert sorted(p.name for p in store.iterdir()) == ["nats-0", "nats-1", "nats-2"]


@pytest.mark.slow  # a 3-server cluster of its own, restarted under load
def test_services_set_up_on_a_restarting_cluster_and_find_their_messages(tmp_path, run_async):
    """The whole cluster restarts; services start with it, not after it (a
    Kubernetes rollout): their stream setup waits out the elections."""
    run = "again"
    stream = stream_name(run, "BATCHES")

    async def publish_and_count(url: str, n: int) -> int:
        nc = await connect(NatsSettings(url=url, connect_attempts=3), "again")
        try:
            js = nc.jetstream()
            for _ in range(n):
                await js.publish(Subjects(run).batches, b"x")
            return int((await js.stream_info(stream)).state.messages)
        finally:
            await nc.close()

    with NatsCluster(3, store_root=tmp_path) as cluster:
        urls = cluster.url
        run_async(set_up_like_the_services(settings(urls, run, 3)))
        assert run_async(publish_and_count(urls, 3)) == 3
        cluster.stop()
        for n in cluster.nodes:
            n.launch()  # no waiting for readiness, as pods start side by side
        # with a service's own patience: the servers were launched an instant ago (3
        # attempts, 0.7 s in all, ran out before they listened on a loaded machine)
        run_async(set_up_like_the_services(settings(urls, run, 3, SERVICE_ATTEMPTS)))
        cluster.start()  # the members run: start() just waits until they are ready
        assert cluster.url == urls  # same ports, same stores
        assert run_async(publish_and_count(urls, 1)) == 4


@pytest.mark.slow  # a 3-server cluster of its own, restarted under load
def test_a_rolling_restart_keeps_every_message_on_every_server(tmp_path, run_async):
    run = "roll"
    stream = stream_name(run, "SAMPLES")

    async def publish(url: str, numbers: range) -> None:
        from services.runtime.publish import publish

        nc = await connect(NatsSettings(url=url, connect_attempts=3), "roll")
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for(run), replicas=3)
            for i in numbers:
                await publish(js, Subjects(run).samples, group(run, i), server_max_payload(nc))
        finally:
            await nc.close()

    with NatsCluster(3, store_root=tmp_path) as cluster:
        run_async(publish(cluster.url, range(5)))
        pids = [n.pid for n in cluster.nodes]
        cluster.rolling_restart()
        assert all(n.running for n in cluster.nodes)
        assert not {n.pid for n in cluster.nodes} & set(pids)  # every one was restarted
        run_async(publish(cluster.url, range(5, 10)))
        deadline = time.monotonic() + 10  # followers apply what the leader acked soon after
        while [_local_messages(cluster, n, stream) for n in cluster.names] != [10, 10, 10]:
            assert time.monotonic() < deadline, [
                _local_messages(cluster, n, stream) for n in cluster.names
            ]
            time.sleep(0.05)

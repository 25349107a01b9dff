"""A local JetStream cluster: N embedded nats-servers routed on loopback.

What `flywheel nats --cluster 3`, `[stack] nats_cluster = 3` and the chaos
tests run. Each member is a `NatsServer` with its own store directory,
server name (`nats-0`, `nats-1`, …, as the Kubernetes StatefulSet names its
pods) and route port, all in one cluster; services get every member's
client URL, comma-separated, as `[nats] url`.

Ports. Client and monitoring ports stay race-free (each server picks its
own and reports it in its ports file, see nats_server). Route ports cannot:
a member needs every other member's route URL on its command line before
any of them runs (JetStream refuses to cluster without configured routes,
and a full list tells each member the cluster's size). So free route ports
are probed; if one is taken before its server binds it, that member exits
with "address already in use" (`NatsPortInUseError`) and the whole cluster
is started again on newly probed ports, a few times at most. Given route
ports (the CLI's `--cluster-port`) are not re-probed.

A new cluster bootstraps only with every member up (JetStream will not
elect its first meta leader from a partial set of the configured routes,
against split brain), so `start()` starts them all; after that any
majority keeps it going, and a member killed and started again rejoins.

Readiness is each member's plain `/healthz`, which answers 200 only once
the member has contact with JetStream's meta leader and its streams are
current. `start()` also waits until the meta leader sees every member as
a current peer (before that it places no replicated stream) and every
stream has a leader again (after a restart, each elects its own);
`start_node(node)` after a `kill(node)` returns when the node has rejoined.
Leaders (the meta group's, a stream's) come from the monitoring endpoint
`/jsz`, so a test can kill -9 exactly the server a stream depends on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from services.runtime.errors import NatsServerError
from services.stack.localdev import nats_jsz
from services.stack.localdev import ports as free_ports
from services.stack.localdev.nats_server import ClusterSpec, NatsPortInUseError, NatsServer

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 5
"""Cluster starts on newly probed route ports before giving up."""

Node = int | str | NatsServer
"""A member, by index, by server name, or itself."""


class NatsCluster:
    """`size` nats-servers with JetStream in one cluster named `name`.

    `ports`, `monitor_ports` and `cluster_ports` fix each member's ports
    (default: free ones); `store_root` holds one store per member
    (`<store_root>/<server name>`; default: temporary, removed by close());
    `config` is extra server configuration for every member, as for
    NatsServer.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        name: str = "flywheel",
        store_root: str | Path | None = None,
        ports: Sequence[int] | None = None,
        monitor_ports: Sequence[int] | None = None,
        cluster_ports: Sequence[int] | None = None,
        config: str | Path | None = None,
        host: str = "127.0.0.1",
        ready_timeout_s: float = 30.0,
    ) -> None:
        if size < 1:
            raise NatsServerError(f"a cluster needs at least one server, not {size}")
        given_ports = {
            "ports": ports,
            "monitor_ports": monitor_ports,
            "cluster_ports": cluster_ports,
        }
        for what, given in given_ports.items():
            if given is not None and len(given) != size:
                raise NatsServerError(f"{what}: {len(given)} given for {size} servers")
        self.size = size
        self.name = name
        self.host = host
        self.store_root = Path(store_root) if store_root is not None else None
        self.ready_timeout_s = ready_timeout_s
        self._ports = list(ports or [0] * size)
        self._monitor_ports = list(monitor_ports or [0] * size)
        self._fixed_cluster_ports = list(cluster_ports) if cluster_ports else None
        self._config = config
        self.nodes: list[NatsServer] = []

    # --- addresses ---------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [f"nats-{i}" for i in range(self.size)]

    @property
    def urls(self) -> list[str]:
        """Every member's client URL (valid once started)."""
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """`[nats] url` for services: every member's client URL, comma-separated."""
        if not self.nodes:
            raise NatsServerError("the NATS cluster has not been started yet: no ports")
        return ",".join(self.urls)

    @property
    def running(self) -> bool:
        """True while every member runs."""
        return bool(self.nodes) and all(n.running for n in self.nodes)

    def node(self, key: Node) -> NatsServer:
        """The member `key` names: an index, a server name, or the member itself."""
        if isinstance(key, NatsServer):
            if key not in self.nodes:
                raise NatsServerError(f"{key.server_name} is not a member of this cluster")
            return key
        if isinstance(key, int):
            return self.nodes[key]
        for n in self.nodes:
            if n.server_name == key:
                return n
        raise NatsServerError(f"no member named {key!r} (members: {', '.join(self.names)})")

    # --- lifecycle ---------------------------------------------------------

    def start(self) -> NatsCluster:
        """Start every member and wait until the meta group has a leader. Returns self.

        Started again after stop() (or with members killed), it starts the
        stopped members on their old ports and stores.
        """
        if self.running:
            return self
        if self.nodes:
            self._start_members()
            return self
        attempts = 1 if self._fixed_cluster_ports else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            self.nodes = self._members(self._fixed_cluster_ports or self._probe_ports())
            try:
                self._start_members()
                return self
            except NatsServerError as e:
                for n in self.nodes:  # a new cluster: nothing in its stores to flush
                    n.kill()
                self.close()
                self.nodes = []
                if not isinstance(e, NatsPortInUseError) or attempt == attempts:
                    raise
                log.warning("nats cluster: %s; starting again on other route ports", e)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _probe_ports(self) -> list[int]:
        ports: set[int] = set()
        while len(ports) < self.size:
            ports.add(free_ports.free_port(self.host))
        return sorted(ports)

    def _members(self, cluster_ports: Sequence[int]) -> list[NatsServer]:
        routes = tuple(f"nats://{self.host}:{p}" for p in cluster_ports)
        return [
            NatsServer(
                port=self._ports[i],
                monitor_port=self._monitor_ports[i],
                store_dir=self.store_root / name if self.store_root is not None else None,
                config=self._config,
                host=self.host,
                ready_timeout_s=self.ready_timeout_s,
                server_name=name,
                cluster=ClusterSpec(self.name, cluster_ports[i], routes),
            )
            for i, name in enumerate(self.names)
        ]

    def _start_members(self) -> None:
        # Launch all first: no member is ready before a quorum of them runs;
        # and watch all at once, so one that exits (a taken port) is seen at once.
        for n in self.nodes:
            n.launch()
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = list(self.nodes)
        while waiting:
            waiting = [n for n in waiting if not n.poll_ready()]
            if waiting and time.monotonic() > deadline:
                raise NatsServerError(
                    f"NATS cluster not ready after {self.ready_timeout_s}s; logs:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.02)
        leader = self.wait_peers_current(max(0.1, deadline - time.monotonic()))
        self.wait_streams_led(max(0.1, deadline - time.monotonic()))
        log.info(
            "nats cluster %s ready: %s (meta leader %s)", self.name, self.url, leader.server_name
        )

    def kill(self, node: Node) -> NatsServer:
        """SIGKILL one member (a crash). Returns it."""
        n = self.node(node)
        n.kill()
        return n

    def stop_node(self, node: Node) -> NatsServer:
        """SIGTERM one member (a clean shutdown). Returns it."""
        n = self.node(node)
        n.stop()
        return n

    def start_node(self, node: Node) -> NatsServer:
        """Start a stopped or killed member on its old ports and store; returns
        once it has rejoined: its /healthz (meta leader known, its streams
        current), and the meta leader counting it as a current peer."""
        n = self.node(node).start()
        self.wait_peers_current(self.ready_timeout_s)
        self.wait_streams_led(self.ready_timeout_s)
        return n

    def restart(self, node: Node) -> NatsServer:
        """Stop one member (SIGTERM) and start it again; returns once it has rejoined."""
        self.stop_node(node)
        return self.start_node(node)

    def rolling_restart(self) -> None:
        """Restart every member in turn, each rejoined before the next goes down."""
        for n in self.nodes:
            self.restart(n)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def close(self) -> None:
        """Stop every member and remove their temporary files (given stores stay)."""
        for n in self.nodes:
            n.close()

    def log_tail(self, lines: int = 10) -> str:
        return "\n".join(f"--- {n.server_name}\n{n.log_tail(lines)}" for n in self.nodes)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- leaders (from /jsz, see nats_jsz) ---------------------------------

    def jsz(self, node: Node, query: str = "") -> dict[str, Any]:
        """One member's `/jsz` monitoring report (e.g. query "streams=true")."""
        return nats_jsz.jsz(self.node(node).monitor_url, query)

    def _reports(self, query: str = "") -> Iterator[dict[str, Any]]:
        """The /jsz report of every running member that answers."""
        for n in self.nodes:
            if not n.running:
                continue
            try:
                yield self.jsz(n, query)
            except nats_jsz.UNREACHABLE:
                continue  # starting or going away: the others answer for it

    def _running(self, name: str | None) -> NatsServer | None:
        return next((n for n in self.nodes if n.server_name == name and n.running), None)

    def meta_leader(self) -> NatsServer | None:
        """The JetStream meta group's leader, or None while there is none."""
        for report in self._reports():
            if leader := self._running(nats_jsz.meta_leader(report)):
                return leader
        return None

    def stream_leader(self, stream: str) -> NatsServer | None:
        """The leader of `stream`'s RAFT group, or None while there is none."""
        for report in self._reports("streams=true"):
            if leader := self._running(nats_jsz.stream_leaders(report).get(stream)):
                return leader
        return None

    def leaderless_streams(self) -> set[str]:
        """Streams (any account) that no running member reports a running leader for."""
        names: set[str] = set()
        led: set[str] = set()
        for report in self._reports("streams=true"):
            for name, leader in nats_jsz.stream_leaders(report).items():
                names.add(name)
                if self._running(leader):
                    led.add(name)
        return names - led

    def wait_streams_led(self, timeout_s: float = 10.0) -> None:
        """Wait until every stream has a running leader (after a restart each
        stream elects its own; until then it answers nothing)."""
        deadline = time.monotonic() + timeout_s
        while waiting := self.leaderless_streams():
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"streams without a leader after {timeout_s}s: {sorted(waiting)}; "
                    f"logs:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def wait_meta_leader(self, timeout_s: float = 10.0) -> NatsServer:
        return self._wait_for("meta leader", self.meta_leader, None, timeout_s)

    def peers_current(self) -> NatsServer | None:
        """The meta leader, if it sees every other running member as an online,
        current peer; else None. Until then it may place no new replicated
        stream ("no suitable peers for placement, peer offline"), even with
        every member's /healthz answering 200."""
        leader = self.meta_leader()
        if leader is None:
            return None
        try:
            current = nats_jsz.current_peers(self.jsz(leader))
        except nats_jsz.UNREACHABLE:
            return None
        others = {n.server_name for n in self.nodes if n.running and n is not leader}
        return leader if others <= current else None

    def wait_peers_current(self, timeout_s: float = 10.0) -> NatsServer:
        """Wait until peers_current(); return the meta leader."""
        what = "meta leader seeing every member current"
        return self._wait_for(what, self.peers_current, None, timeout_s)

    def wait_stream_leader(
        self, stream: str, *, other_than: Node | None = None, timeout_s: float = 10.0
    ) -> NatsServer:
        """Wait until `stream` has a running leader (other than `other_than`, e.g.
        the member just killed); return it."""
        exclude = self.node(other_than) if other_than is not None else None
        return self._wait_for(
            f"a leader of stream {stream}", lambda: self.stream_leader(stream), exclude, timeout_s
        )

    def _wait_for(
        self,
        what: str,
        find: Callable[[], NatsServer | None],
        exclude: NatsServer | None,
        timeout_s: float,
    ) -> NatsServer:
        deadline = time.monotonic() + timeout_s
        while True:
            found = find()
            if found is not None and found is not exclude:
                return found
            if time.monotonic() > deadline:
                raise NatsServerError(f"no {what} within {timeout_s}s; logs:\n{self.log_tail()}")
            time.sleep(0.05)


def embedded_nats(servers: int, *, port: int = 0, store_dir: Path) -> NatsServer | NatsCluster:
    """What `flywheel up` starts: one server (store `store_dir`), or a cluster
    (stores `store_dir/nats-<i>`, client ports `port + i` when `port` is set)."""
    if servers == 1:
        return NatsServer(port=port, store_dir=store_dir)
    ports = [port + i for i in range(servers)] if port else None
    return NatsCluster(servers, ports=ports, store_root=store_dir)

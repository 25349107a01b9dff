"""`flywheel nats`: run an embedded nats-server in the foreground for the local stack.

The default port (4222) and URL match `NatsSettings.url`'s default, so the
services of a local stack find it without configuration. The store directory
persists between runs, so streams (and their unconsumed messages) survive a
restart of the local stack, as they would with a real deployment.

`--cluster 3` runs three servers in one JetStream cluster instead (see
services.stack.localdev.nats_cluster): client ports `--port` + i, monitoring
`--monitor-port` + i, routes `--cluster-port` + i, stores
`<store-dir>/nats-<i>`. Services then need every URL in `[nats] url` and
`[nats] replicas = 3` to replicate their streams.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from services.runtime.errors import NatsServerError
from services.stack.localdev.nats_cluster import NatsCluster
from services.stack.localdev.nats_server import NatsServer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel nats", description="Run a nats-server with JetStream for the local stack."
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument(
        "--port",
        type=int,
        default=4222,
        help="client port; 0 picks a free one (default: %(default)s)",
    )
    p.add_argument(
        "--monitor-port",
        type=int,
        default=8222,
        help="HTTP monitoring port (/varz, /jsz); 0 picks a free one (default: %(default)s)",
    )
    p.add_argument(
        "--store-dir",
        type=Path,
        default=Path(".flywheel/nats"),
        help="JetStream store directory (default: %(default)s)",
    )
    p.add_argument("--config", type=Path, default=None, help="extra nats-server config file")
    p.add_argument(
        "--cluster",
        type=int,
        default=1,
        choices=range(1, 6),
        metavar="N",
        help="servers: 1, or 3 for a JetStream cluster on loopback (default: %(default)s)",
    )
    p.add_argument(
        "--cluster-port",
        type=int,
        default=6222,
        help="first route port of a cluster; 0 picks free ones (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run until SIGINT/SIGTERM (or until the server dies). Returns an exit code."""
    args = parser().parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    server = _server(args)
    try:
        return _serve(server, args.store_dir, stop)
    finally:
        server.close()
        for s, h in previous.items():
            signal.signal(s, h)


def _server(args: argparse.Namespace) -> NatsServer | NatsCluster:
    if args.cluster == 1:
        return NatsServer(
            host=args.host,
            port=args.port,
            monitor_port=args.monitor_port,
            store_dir=args.store_dir,
            config=args.config,
        )

    def ports(first: int) -> list[int] | None:
        return [first + i for i in range(args.cluster)] if first else None

    return NatsCluster(
        args.cluster,
        host=args.host,
        ports=ports(args.port),
        monitor_ports=ports(args.monitor_port),
        cluster_ports=ports(args.cluster_port),
        store_root=args.store_dir,
        config=args.config,
    )


def _serve(server: NatsServer | NatsCluster, store_dir: Path, stop: threading.Event) -> int:
    try:
        server.start()
    except NatsServerError as e:
        print(f"flywheel nats: {e}", file=sys.stderr, flush=True)
        return 1
    if isinstance(server, NatsServer):
        print(
            f"nats-server ready at {server.url} (monitoring {server.monitor_url}, "
            f"store {store_dir}); Ctrl-C stops it",
            flush=True,
        )
    else:
        monitors = ", ".join(n.monitor_url for n in server.nodes)
        print(
            f"NATS cluster of {server.size} ready (monitoring {monitors}, stores in "
            f"{store_dir}); Ctrl-C stops it. In the run file:\n"
            f'[nats]\nurl = "{server.url}"\nreplicas = {server.size}',
            flush=True,
        )
    while not stop.wait(0.5):
        if not server.running:
            print(
                f"flywheel nats: nats-server exited; log tail:\n{server.log_tail()}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

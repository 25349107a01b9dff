"""`flywheel sandbox --socket PATH`: serve sandboxed reward and tool processes to the
services beside it (services/sandbox/server.py).

One option: where the socket goes (default $FLYWHEEL_SANDBOX_SOCKET, else
/run/flywheel-sandbox/pool.sock); `--check` says what this host gives a call
(bubblewrap or plain processes; a cgroup per child, or per-process memory
limits) and exits. Everything a child may see and use comes
from the pool that asks for it; the server decides only whether this host
can confine it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

DEFAULT_SOCKET = "/run/flywheel-sandbox/pool.sock"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel sandbox",
        description="Start sandboxed reward and tool processes for the services beside it, "
        "over a unix socket (a sidecar without their credentials or volumes).",
    )
    p.add_argument(
        "--socket",
        type=Path,
        default=Path(os.environ.get("FLYWHEEL_SANDBOX_SOCKET", DEFAULT_SOCKET)),
        help="unix socket to listen on (default: $FLYWHEEL_SANDBOX_SOCKET or %(default)s)",
    )
    p.add_argument("--log-level", default="INFO", help="Python logging level")
    p.add_argument(
        "--check",
        action="store_true",
        help="say what this host gives a sandboxed call (bubblewrap or plain processes, "
        "how a call's memory is bounded) and exit: 0 when calls are confined, 1 when not",
    )
    return p


def check() -> int:
    """`--check`: the walls and the memory limit a call gets on this host, one line each."""
    from services.sandbox import jail

    reason = jail.probe()
    walls = "bubblewrap" if reason is None else f"plain processes only ({reason})"
    print(f"walls:  {walls}")
    print(f"memory: {jail.memory_mode()}")
    return 0 if reason is None else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.check:
        return check()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from services.sandbox.server import Server

    server = Server(args.socket)

    def stop(_sig: int, _frame: FrameType | None) -> None:
        server.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve()
    return 0

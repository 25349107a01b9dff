"""`flywheel sandbox --socket PATH`: serve sandboxed reward and tool processes to the
services beside it (services/sandbox/server.py).

One option: where the socket goes (default $FLYWHEEL_SANDBOX_SOCKET, else
/run/flywheel-sandbox/pool.sock). Everything a child may see and use comes
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
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

"""The one way Flywheel picks a free TCP port: bind port 0 and ask what the kernel gave.

Racy by nature (the port is free when probed, and someone else may take it
before its user binds it); callers that cannot tolerate that let the
server pick its own port and report it (nats_server's ports file), and the
ones that cannot do that retry (nats_cluster's route ports).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that was free just now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

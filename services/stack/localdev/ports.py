"""Free TCP ports for the processes `flywheel up` starts (and for the tests).

A listening port is picked below the kernel's ephemeral range (Linux:
`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default), not by
binding port 0, which hands out a port from inside it. The supervisor
restarts a service on the port it was planned with; a port from the
ephemeral range can meanwhile have become the local end of an outgoing
connection (every service reconnecting to a restarted nats-server, a
metrics scrape), and the restarted service then cannot bind it (seen in
the chaos suite: the trainer died twice on "address already in use").

Ports are handed out in turn from a random start, so one process never
gives the same port twice in a row of plans; each is checked free by
binding it (the usual race with whoever binds it next remains: the caller
hands it to a process that binds it moments later).
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOWEST = 10_000  # below: ports services commonly own (4222, 8080, 9090, ...)
_lock = threading.Lock()
_next: int | None = None


def _ephemeral_start() -> int:
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems' ranges start higher
    return first


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start_at(fraction: float) -> None:
    """Begin the next search `fraction` of the way up the range below the ephemeral one.

    Parallel test workers (pytest-xdist) each start in their own slice, so
    two of them do not hand out one port in the moment before it is bound.
    """
    global _next
    with _lock:
        _next = LOWEST + int((_ephemeral_start() - LOWEST) * min(max(fraction, 0.0), 0.999))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, below the ephemeral range where there is room."""
    global _next
    top = _ephemeral_start()
    if top - LOWEST < 1000:  # no room below the range: let the kernel pick
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    with _lock:
        if _next is None:
            _next = random.randrange(LOWEST, top)
        for _ in range(top - LOWEST):
            port = _next
            _next = LOWEST if _next + 1 >= top else _next + 1
            if _bindable(host, port):
                return port
    raise OSError(f"no free port in {LOWEST}-{top - 1}")

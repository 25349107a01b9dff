"""The tests' one free-port helper.

`flywheel up` picks its ports the same way (bind port 0, read it back, close);
once services/common grows its own `free_port`, this module re-exports it.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

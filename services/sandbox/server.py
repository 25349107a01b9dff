"""The sandbox server: reward and tool processes started for other services, over a unix socket.

On Kubernetes the rollout worker and the trainer hold the NATS password and
the trainer mounts /data writable. Their rewards and tools run what the
policy wrote, so they run in neither container but in a sidecar that holds
no secret, mounts no weights, has a read-only root filesystem and no
service-account token: this server. The two containers share only an
emptyDir with its socket.

The protocol is the pools' own (protocol.py), plus one frame first. A
connection asks for one child: `["spawn", {modules, limits, required_by,
audit, cpu_s}]` (jail.Sandbox.to_wire); the server answers `["ready",
confined]` and hands the connection to a child it starts as jail.plan says
(bubblewrap here too), as that child's stdin and stdout; from then on the
frames go straight between the pool and the child. Where the server's host
cannot give a sandbox, a request that requires one is answered
`["refused", why]` (the same ConfigError line a local pool raises). When the
connection closes (the pool killed the child on a time-out, or closed), or
the child dies, the server kills the child — its whole PID namespace — and
closes the connection.

The pool side is `VerifierPool(remote=PATH)` / `ToolPool(remote=PATH)`,
which services use when `sandbox_socket` is set ([rollout], [trainer]).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

import msgpack

from services.runtime.errors import ConfigError
from services.sandbox import jail

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
HELLO_TIMEOUT_S = 10.0
MAX_HELLO = 1 << 20


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    """Exactly n bytes (never more: what follows the hello is the child's to read)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError("the pool closed the connection")
        buf += chunk
    return bytes(buf)


def _send(conn: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    conn.sendall(_LEN.pack(len(data)) + data)


def read_hello(conn: socket.socket) -> tuple[jail.Sandbox, int]:
    """The spawn request; ValueError if the frame is not one."""
    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
    if n > MAX_HELLO:
        raise ValueError(f"a spawn request of {n} bytes")
    hello = msgpack.unpackb(_recv_exact(conn, n), raw=False)
    if not (isinstance(hello, list) and len(hello) == 2 and hello[0] == "spawn"):
        raise ValueError(f"not a spawn request: {hello!r:.200}")
    spec = hello[1]
    try:
        sandbox, cpu_s = jail.Sandbox.from_wire(spec), int(spec["cpu_s"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"bad spawn request: {e}") from e
    if cpu_s < 1:
        raise ValueError(f"cpu_s must be >= 1, got {cpu_s}")
    return sandbox, cpu_s


class Server:
    """Accepts connections on `path`; each gets a child of its own until either end goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stop = threading.Event()
        self._children: dict[int, tuple[subprocess.Popen[bytes], jail.Spawn]] = {}
        self._lock = threading.Lock()

    def serve(self) -> None:
        """Run until `stop` is set; then kill every child and remove the socket."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a stale socket of a previous run
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o660)  # the pod's containers share a uid/group; no one else
        listener.listen(64)
        listener.settimeout(0.2)
        reason = jail.probe()
        log.info(
            "sandbox server on %s: %s",
            self.path,
            "children run in bubblewrap"
            if reason is None
            else f"this host has no sandbox ({reason}); only pools that allow it get plain "
            "processes",
        )
        log.info("sandbox server: memory per call: %s", jail.memory_mode())
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._connection, args=(conn,), daemon=True).start()
        finally:
            listener.close()
            self.path.unlink(missing_ok=True)
            with self._lock:
                children = list(self._children.values())
            for proc, spawn in children:
                _kill(proc, spawn)

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(HELLO_TIMEOUT_S)
            try:
                sandbox, cpu_s = read_hello(conn)
            except (EOFError, OSError, ValueError) as e:
                log.warning("sandbox server: dropped a connection: %s", e)
                return
            try:
                sandbox.check()
                spawn = jail.plan(sandbox, cpu_s)
            except ConfigError as e:
                with contextlib.suppress(OSError):
                    _send(conn, ["refused", str(e)])
                return
            conn.settimeout(None)
            try:
                proc = subprocess.Popen(
                    spawn.argv,
                    stdin=conn.fileno(),
                    stdout=conn.fileno(),
                    env=spawn.env,
                    cwd=spawn.cwd,
                    pass_fds=spawn.pass_fds,
                    start_new_session=not spawn.confined,
                )
            except OSError as e:
                spawn.cleanup()
                with contextlib.suppress(OSError):
                    _send(conn, ["refused", f"cannot start a child: {e}"])
                return
            finally:
                spawn.close_fds()
            with self._lock:
                self._children[proc.pid] = (proc, spawn)
            try:
                _send(conn, ["ready", spawn.confined])
                self._watch(conn, proc)
            except OSError as e:
                log.warning("sandbox server: connection of child %d failed: %s", proc.pid, e)
            finally:
                _kill(proc, spawn)
                with self._lock:
                    self._children.pop(proc.pid, None)

    def _watch(self, conn: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        """Until the pool hangs up (POLLRDHUP: nothing read, the child's data stays) or the
        child exits."""
        pidfd = os.pidfd_open(proc.pid)
        try:
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLRDHUP)
            poller.register(pidfd, select.POLLIN)
            while not self.stop.is_set() and not poller.poll(500):
                pass
        finally:
            os.close(pidfd)


def _kill(proc: subprocess.Popen[bytes], spawn: jail.Spawn) -> None:
    """The child and everything it started (its PID namespace, or its process group)."""
    with contextlib.suppress(ProcessLookupError):
        if spawn.confined:
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    spawn.cleanup()

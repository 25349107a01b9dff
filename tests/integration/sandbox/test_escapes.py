"""The escape battery: code a policy could write, run as the python tool and as a custom
reward, trying every way out we know of. Every case must be refused, and each is
checked on its effect on this host — the file is not there, the listener got
nothing, the signal never came, no process is left — not on a log line.

The pools are the ones the services use (services/sandbox: pool.py, in jail.py's bubblewrap),
sized one child each and started once for the module, after a secret was put
into this process's environment (as the NATS password is in a service's).
Where the host has no sandbox these tests skip saying why; in CI they fail
(tests/harness/sandbox.py).

The battery runs in both modes the product ships (`mode`): here, the pools
start their children from this test process (root in CI: bubblewrap is
privileged and each child gets a uid of its own); test_escapes_pod.py runs
every case again with the children started by a `flywheel sandbox` server
running as the pod's non-root uid (bubblewrap in a user namespace, the calls
sharing the server's uid, no cgroup), as every Kubernetes pod runs them.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import Any

import pytest

from services.sandbox import ToolPool, VerifierPool, jail
from services.sandbox.jail import UID_BASE, Limits, mounts
from services.tasks.registry import as_fields
from services.tasks.rewards import CustomReward
from services.tasks.tools import CALL
from tests.harness.poll import wait_for
from tests.harness.sandbox import CONFINED, POD_UID, PodServer, require_sandbox

REPO = Path(__file__).resolve().parents[3]
REWARD = "tests.integration.sandbox.escape_fixtures:run_code"
SCORE = "services.tasks.rewards:score"
PY = {"type": "python", "tag": "python", "description": ""}
TIMEOUT_S = 5.0
SECRET_VAR = "FLYWHEEL_NATS__PASSWORD"
SECRET = f"secret-{token_hex(12)}"
LIMITS = Limits()
# What the sandbox's /tmp holds before any call: the top of a checkout or virtualenv
# that lives under /tmp, bound there (jail.mounts). A call's leftovers are the rest.
KEPT = sorted({Path(a).parts[2] for a in mounts(CONFINED.modules)[0] if a.startswith("/tmp/")})
# Before every case's code: should a regression ever run it outside the walls (root,
# the host's /proc), it stops instead of trying a fork bomb or kill(-1) on this host.
# The case then fails for want of its output; `unprivileged` says why.
SEATBELT = """
import os as _os
if _os.getuid() == 0 or _os.path.isdir("/proc/self"):
    raise SystemExit("not in the sandbox: refusing to try")
"""


@dataclass
class Outcome:
    """What a run of code came back as: the tool's text (or the reward's parts)."""

    text: str
    error: str | None
    reward: float = 0.0
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def leaked(self) -> bool:
        return SECRET in self.text or self.numbers.get("leaked", 0.0) > 0

    def number(self, name: str) -> float:
        if name in self.numbers:
            return self.numbers[name]
        for word in self.text.split():
            key, _, value = word.partition("=")
            if key == name:
                return float(value)
        raise AssertionError(f"{name}= not in the output: {self.text!r} {self.numbers}")


class Pools:
    """A tool pool and a verifier pool on an event loop of their own, for sync tests: their
    children started by this process (`mode` "service") or by a sandbox server running
    as the pod's uid ("pod")."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.server = PodServer() if mode == "pod" else None
        remote = self.server.sock if self.server is not None else None
        self.loop = asyncio.new_event_loop()
        self.tool = ToolPool(
            1, TIMEOUT_S, memory_mb=512, tools=[PY], sandbox=CONFINED, remote=remote
        )
        self.verifier = VerifierPool(1, TIMEOUT_S, sandbox=CONFINED, remote=remote)
        for pool in (self.tool, self.verifier):
            self.loop.run_until_complete(pool.start())
            assert pool.confined, "the pool fell back to plain processes"

    @property
    def remote(self) -> Path | None:
        return self.server.sock if self.server is not None else None

    def memory_mode(self) -> str:
        """How a call's memory is bounded where this mode's children start."""
        if self.server is None:
            return jail.memory_mode()
        return PodServer.check().partition("memory: ")[2].strip()

    def close(self) -> None:
        for pool in (self.tool, self.verifier):
            self.loop.run_until_complete(pool.close())
        self.loop.close()
        if self.server is not None:
            self.server.close()

    def run(self, kind: str, code: str) -> Outcome:
        code = SEATBELT + code
        if kind == "tool":
            out = self.loop.run_until_complete(self.tool.run(CALL, PY, code))
            return Outcome(out.text, out.error)
        parts = [as_fields(CustomReward(fn=REWARD, name="run"))]
        r = self.loop.run_until_complete(self.verifier.call(SCORE, parts, code, SECRET, {}))
        numbers = {k.removeprefix("run."): v for k, v in r.parts.items()}
        return Outcome(r.error or "", r.error, r.reward, numbers)

    def zygote(self, kind: str) -> int:
        """The host pid of the pool's (only) child process: bubblewrap's grandchild (of this
        process, or of the pod's server: the pool's memory limit tells its child)."""
        pool = self.tool if kind == "tool" else self.verifier
        root = self.server.proc.pid if self.server is not None else pool._all[0].pid or 0
        exe = jail.python().encode()
        mine = f"--memory={pool.sandbox.limits.memory_mb}".encode()
        python = [p for p in descendants(root) if cmdline(p).startswith(exe)]
        python = [p for p in python if mine in cmdline(p).split(b"\0")]
        assert len(python) == 1, python
        return python[0]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def ppid_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def live_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in live_pids():
        parent = ppid_of(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def with_marker(marker: str) -> list[int]:
    return [p for p in live_pids() if marker.encode() in cmdline(p)]


def pidns_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def in_pidns(ns: str) -> list[int]:
    """The processes of one PID namespace (a slot's: bubblewrap's init, its zygote, calls)."""
    return [p for p in live_pids() if pidns_of(p) == ns]


@pytest.fixture(scope="module")
def mode() -> str:
    """Who starts the sandbox's children: this process (test_escapes_pod.py: the pod's)."""
    return "service"


@pytest.fixture(scope="module")
def pools(mode: str) -> Iterator[Pools]:
    require_sandbox()
    saved = os.environ.get(SECRET_VAR)
    os.environ[SECRET_VAR] = SECRET  # as the NATS password is in a service's environment
    p = Pools(mode)
    try:
        yield p
    finally:
        p.close()
        if saved is None:
            os.environ.pop(SECRET_VAR, None)
        else:
            os.environ[SECRET_VAR] = saved


@dataclass
class Host:
    """This host's side of a case: files the sandbox must not touch, listeners that must
    hear nothing, a signal that must not arrive."""

    tmp: Path
    token: str = field(default_factory=lambda: token_hex(6))
    sockets: list[socket.socket] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.weights = self.tmp / "data" / "weights"
        (self.weights / "v000001").mkdir(parents=True)
        self.best = self.weights / "best.json"
        self.best.write_text('{"version": 1}')
        self.secret_file = self.tmp / "nats-credentials.env"
        self.secret_file.write_text(f"password={SECRET}\n")
        self.repo_new = REPO / f".escaped-{self.token}"
        self.repo_sentinel = REPO / f".escape-sentinel-{self.token}"
        self.repo_sentinel.write_text("keep me")
        self.tmp_new = self.tmp / "escaped"
        self.reward_module = REPO / "services" / "tasks" / "rewards.py"
        self.reward_text = self.reward_module.read_bytes()

    def close(self) -> None:
        for s in self.sockets:
            s.close()
        for p in (self.repo_new, self.repo_sentinel):
            p.unlink(missing_ok=True)
        if self.reward_module.read_bytes() != self.reward_text:  # put it back, then fail
            self.reward_module.write_bytes(self.reward_text)
            raise AssertionError("the sandbox changed services/tasks/rewards.py")

    def listener(self, kind: int, address: Any, family: int = socket.AF_INET) -> socket.socket:
        s = socket.socket(family, kind)
        s.bind(address)
        if kind == socket.SOCK_STREAM:
            s.listen(8)
        s.setblocking(False)
        self.sockets.append(s)
        return s

    def heard_nothing(self, s: socket.socket, wait_s: float = 0.5) -> None:
        ready, _, _ = select.select([s], [], [], wait_s)
        assert not ready, f"the listener on {s.getsockname()!r} heard from the sandbox"

    def unchanged(self) -> None:
        """Nothing the service could write was written by the case."""
        assert not self.repo_new.exists() and not self.tmp_new.exists()
        assert self.repo_sentinel.read_text() == "keep me"
        assert self.best.read_text() == '{"version": 1}'
        assert sorted(p.name for p in self.weights.iterdir()) == ["best.json", "v000001"]
        assert (
            hashlib.sha256(self.reward_module.read_bytes()).digest()
            == hashlib.sha256(self.reward_text).digest()
        )


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path)
    received: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, _f: received.append(s))
    h.signals = received
    try:
        yield h
        h.unchanged()  # every case, whatever it tried
    finally:
        signal.signal(signal.SIGUSR1, old)
        h.close()


Run = Callable[[str], Outcome]


# ── the cases: each tries one way out, and checks this host's side ──────────
def fork_exec_shell(run: Run, h: Host, p: Pools, kind: str) -> None:
    """The hole of the audit-hook sandbox: _posixsubprocess.fork_exec ran an unconfined
    /bin/sh that wrote a file. Now the shell runs inside the walls."""
    targets = " ".join(str(t) for t in (h.tmp_new, h.repo_new, h.weights / "x"))
    run(f"""
import _posixsubprocess, os
r, w = os.pipe()
for t in {targets.split()!r}:
    pid = _posixsubprocess.fork_exec(
        [b"/bin/sh", b"-c", b"echo pwned > " + t.encode()], [b"/bin/sh"], True, (w,), None,
        None, -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, None, -1, None, False)
    print(os.waitpid(pid, 0))
""")


def subprocess_shell(run: Run, h: Host, p: Pools, kind: str) -> None:
    run(f"""
import subprocess
subprocess.run(["/bin/sh", "-c", "echo pwned > {h.repo_new}; rm -f {h.repo_sentinel}"])
os_system = __import__("os").system("echo pwned > {h.tmp_new}")
""")


def write_anywhere(run: Run, h: Host, p: Pools, kind: str) -> None:
    """open(..., 'w') where the service can write: the repository, its code, the weights
    directory; os.remove of a file there.

    A repository that lives under /tmp (a clone in /tmp) is bound read-only inside the
    call's own /tmp, a tmpfs, and the directories above that bind are the tmpfs's: in the
    pod's mode (a user namespace) they belong to the call's uid, so a new file there is
    written, into the call's private /tmp. That is no escape as long as neither the host
    nor the next call sees it: both are checked."""
    out = run(f"""
import os
done = []
for path, mode in [({str(h.repo_new)!r}, "w"), ({str(h.reward_module)!r}, "a"),
                   ({str(h.best)!r}, "w"), ({str(h.weights / "v000002")!r}, "w"),
                   ({str(h.tmp_new)!r}, "w"), ("/usr/escaped", "w")]:
    try:
        with open(path, mode) as f:
            f.write("# escaped")
        done.append(path)
    except OSError as e:
        print("refused", e.errno)
for path in [{str(h.repo_sentinel)!r}, {str(h.best)!r}]:
    try:
        os.remove(path)
        done.append(path)
    except OSError as e:
        print("refused", e.errno)
# the repository's new file inside this call's own /tmp (a clone in /tmp): not the host's
private = done == [{str(h.repo_new)!r}] and {str(h.repo_new)!r}.startswith("/tmp/")
print(f"written={{len(done)}} private={{int(private)}}")
""")
    assert out.number("written") == out.number("private"), out
    if out.number("private"):
        assert not h.repo_new.exists(), f"{h.repo_new}: written on the host"
        seen = run(f'import os\nprint(f"seen={{int(os.path.exists({str(h.repo_new)!r}))}}")')
        assert seen.number("seen") == 0, seen  # the next call's /tmp holds none of it


def read_host_files(run: Run, h: Host, p: Pools, kind: str) -> None:
    paths = [str(h.secret_file), "/etc/shadow", "/root/.bashrc", str(REPO / "pyproject.toml")]
    out = run(f"""
for path in {paths!r}:
    try:
        print(open(path).read())
    except OSError as e:
        print("refused", e.errno)
""")
    assert not out.leaked, out


def environment(run: Run, h: Host, p: Pools, kind: str) -> None:
    """The service's environment (here: a secret, on Kubernetes: the NATS password) is
    not the sandbox's."""
    out = run(f"""
import os
print(dict(os.environ))
print(os.environ.get({SECRET_VAR!r}))
""")
    assert not out.leaked, out
    if kind == "tool":
        assert SECRET_VAR not in out.text, out


def proc_tricks(run: Run, h: Host, p: Pools, kind: str) -> None:
    """/proc/<parent>/environ, /proc/1, /proc/self/root/.. to the host."""
    out = run(f"""
import os
for path in ["/proc/{os.getpid()}/environ", "/proc/1/environ", f"/proc/{{os.getppid()}}/environ",
             "/proc/self/environ", "/proc/self/root/../../proc/1/environ",
             "/proc/1/root{h.secret_file}", "/proc/self/root/..{h.secret_file}"]:
    try:
        print(open(path, "rb").read().decode(errors="replace"))
    except OSError as e:
        print("refused", path, e.errno)
for path in ["/proc/self/root/..", "/proc/1/root", "/proc/1/cwd", "/proc"]:
    try:
        print(path, os.listdir(path))
    except OSError as e:
        print("refused", path, e.errno)
""")
    assert not out.leaked, out


def tcp_connect(run: Run, h: Host, p: Pools, kind: str) -> None:
    s = h.listener(socket.SOCK_STREAM, ("0.0.0.0", 0))
    port = s.getsockname()[1]
    run(f"""
import socket
for host in ["127.0.0.1", {_host_ip()!r}]:
    try:
        c = socket.create_connection((host, {port}), timeout=1)
        c.sendall(b"escaped")
        print("connected", host)
    except OSError as e:
        print("refused", host, e)
""")
    h.heard_nothing(s)


def udp_sendmsg(run: Run, h: Host, p: Pools, kind: str) -> None:
    s = h.listener(socket.SOCK_DGRAM, ("0.0.0.0", 0))
    port = s.getsockname()[1]
    run(f"""
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for host in ["127.0.0.1", {_host_ip()!r}]:
    for send in (lambda a: u.sendmsg([b"escaped"], [], 0, a), lambda a: u.sendto(b"escaped", a)):
        try:
            send((host, {port}))
            print("sent", host)
        except OSError as e:
            print("refused", host, e)
""")
    h.heard_nothing(s)


def dns(run: Run, h: Host, p: Pools, kind: str) -> None:
    """A name lookup, and a DNS query to a resolver this host runs."""
    s = h.listener(socket.SOCK_DGRAM, ("127.0.0.1", 0))
    port = s.getsockname()[1]
    out = run(f"""
import socket
try:
    print(socket.getaddrinfo("example.com", 80))
    print("resolved=1")
except OSError as e:
    print("resolved=0", e)
q = bytes.fromhex("123401000001000000000000076578616d706c6503636f6d0000010001")
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for server in [("127.0.0.1", {port}), ("8.8.8.8", 53), ("1.1.1.1", 53)]:
    try:
        u.sendto(q, server)
        u.settimeout(0.5)
        print(u.recv(512))
        print("answered=1")
    except OSError as e:
        print("refused", server, e)
""")
    h.heard_nothing(s)
    assert out.number("resolved") == 0, out
    assert "answered=1" not in out.text, out


def unix_sockets(run: Run, h: Host, p: Pools, kind: str) -> None:
    """Unix sockets of the host: a path one and an abstract one (per network namespace)."""
    path = h.tmp / "s.sock"
    abstract = f"\0flywheel-escape-{h.token}"
    listeners = [
        h.listener(socket.SOCK_STREAM, str(path), socket.AF_UNIX),
        h.listener(socket.SOCK_STREAM, abstract, socket.AF_UNIX),
    ]
    run(f"""
import socket
for address in [{str(path)!r}, {abstract!r}]:
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(address)
        c.sendall(b"escaped")
        print("connected", repr(address))
    except OSError as e:
        print("refused", repr(address), e)
""")
    for s in listeners:
        h.heard_nothing(s)


def ctypes_libc(run: Run, h: Host, p: Pools, kind: str) -> None:
    """ctypes.CDLL(None) loads: libc's system(), and raw syscalls, still meet the walls."""
    run(f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.system(b"echo pwned > {h.repo_new}; echo pwned > {h.tmp_new}")
libc.kill({os.getpid()}, 10)
""")
    time.sleep(0.3)
    assert h.signals == [], "SIGUSR1 from the sandbox reached this process"


def namespaces_and_ptrace(run: Run, h: Host, p: Pools, kind: str) -> None:
    """Making a user namespace (capabilities over new namespaces), tracing the zygote:
    refused by the seccomp filter."""
    out = run("""
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
print(f"unshare={libc.unshare(0x10000000)}")
print(f"unshare_net={libc.unshare(0x40000000)}")
print(f"unshare_cmd={subprocess.run(['unshare', '-U', '-r', 'true']).returncode}")
print(f"ptrace={libc.ptrace(16, os.getppid(), 0, 0)}")
""")
    assert out.number("unshare") == -1 and out.number("unshare_net") == -1, out
    assert out.number("unshare_cmd") != 0 and out.number("ptrace") == -1, out


def kill_the_parent(run: Run, h: Host, p: Pools, kind: str) -> None:
    """os.kill of the worker that runs the pool (this test process), of pid 1, of all."""
    run(f"""
import os, signal
for pid in ({os.getpid()}, 1, -1):
    try:
        os.kill(pid, signal.SIGUSR1)
        print("sent", pid)
    except OSError as e:
        print("refused", pid, e.errno)
""")
    time.sleep(0.5)
    assert h.signals == [], "SIGUSR1 from the sandbox reached this process"


def fork_bomb(run: Run, h: Host, p: Pools, kind: str) -> None:
    """Every process forks forever: RLIMIT_NPROC holds it, the time-out kills the whole
    PID namespace, nothing of it is left, and the pool serves the next call."""
    ns = pidns_of(p.zygote(kind))
    out = run("""
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""")
    assert out.error == "timeout" or "timed out" in out.text, out
    assert ns is not None
    # A bound, not a speed: the kernel's teardown of a namespace full of forking processes
    # took over 10 s once under make test's load (2 cores, every suite beside it).
    wait_for(lambda: not in_pidns(ns), 30, "every process of the fork bomb's slot to be gone")
    assert run("print(f'alive={6 * 7}')").number("alive") == 42


def process_limit(run: Run, h: Host, p: Pools, kind: str) -> None:
    """How many processes a call can make: fewer than RLIMIT_NPROC, and none survive it."""
    ns = pidns_of(p.zygote(kind))
    out = run("""
import os, time
n = 0
for _ in range(1000):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    n += 1
print(f"forks={n}")
""")
    assert 0 < out.number("forks") < LIMITS.processes, out
    assert ns is not None
    # Processes left behind put the slot in doubt: killed, reaped, and the slot replaced
    # (its namespace gone), or at least none left beside bubblewrap's init and the zygote.
    wait_for(lambda: len(in_pidns(ns)) <= 2, 10, "nothing of the call left in its slot")


def exceed_file_size(run: Run, h: Host, p: Pools, kind: str) -> None:
    """RLIMIT_FSIZE stops one file; the size of /tmp stops many."""
    out = run(f"""
import os
KEPT = {KEPT!r}
try:
    with open("/tmp/big", "wb") as f:
        for _ in range(100):
            f.write(b"x" * (1 << 20))
            f.flush()
except OSError as e:
    print(f"big_errno={{e.errno}}")
print(f"big={{os.path.getsize('/tmp/big')}}")
total = 0
try:
    for i in range(100):
        with open(f"/tmp/part{{i}}", "wb") as f:
            for _ in range(15):
                f.write(b"x" * (1 << 20))
                f.flush()
except OSError as e:
    print(f"tmp_errno={{e.errno}}")
print(f"tmp={{sum(os.path.getsize('/tmp/' + n) for n in os.listdir('/tmp') if n not in KEPT)}}")
""")
    assert out.number("big_errno") == errno.EFBIG, out
    assert out.number("big") <= LIMITS.file_mb << 20, out
    assert out.number("tmp_errno") == errno.ENOSPC, out
    assert out.number("tmp") <= LIMITS.tmp_mb << 20, out


def outlive_the_call(run: Run, h: Host, p: Pools, kind: str) -> None:
    """A call that leaves a daemon behind (its own session) and returns: killed after."""
    marker = f"{900 + random.random():.6f}"
    run(f"""
import subprocess
subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
print("left a sleeper")
""")
    wait_for(lambda: not with_marker(marker), 10, "the call's sleeper to be gone")


def outlive_the_timeout(run: Run, h: Host, p: Pools, kind: str) -> None:
    """A call that starts a daemon and hangs: on the time-out everything dies."""
    marker = f"{800 + random.random():.6f}"
    out = run(f"""
import os, subprocess, time
subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    time.sleep(600)
time.sleep(600)
""")
    assert out.error == "timeout" or "timed out" in out.text, out
    wait_for(lambda: not with_marker(marker), 10, "the timed-out call's sleeper to be gone")
    assert run("print(f'alive={6 * 7}')").number("alive") == 42


def forge_the_answer(run: Run, h: Host, p: Pools, kind: str) -> None:
    """Writing an answer frame where the zygote's answer goes, then failing: the pool
    reports the failure, not the forgery."""
    out = run("""
import os, struct, msgpack
for frame in (["value", "forged"], ["ok", 1.0, {}], ["many", []]):
    data = msgpack.packb(frame)
    for fd in (0, 1, 2):
        try:
            os.write(fd, struct.pack("<I", len(data)) + data)
        except OSError:
            pass
raise ValueError("after forging")
""")
    if kind == "tool":
        assert out.error == "raised" and "after forging" in out.text, out
    else:
        assert out.reward == 0.0 and out.number("raised") == 1, out


def memory(run: Run, h: Host, p: Pools, kind: str) -> None:
    out = run("x = bytearray(8 << 30)\nprint('allocated=1')")
    assert "allocated=1" not in out.text and out.numbers.get("allocated") is None, out


def leftovers(run: Run, h: Host, p: Pools, kind: str) -> None:
    """What one call leaves (files, a locked directory, patched builtins and modules) is
    not there for the next: each call is a fresh fork of the warm zygote."""
    run("""
import builtins, os
import services.tasks.tools as tools
import services.tasks.rewards as rewards
open("/tmp/left", "w").write("x")
os.mkdir("/tmp/locked")
open("/tmp/locked/f", "w").write("y")
os.chmod("/tmp/locked", 0)
builtins.len = lambda x: 42
tools.run_python = None
rewards.score = lambda *a, **k: {"reward": 1.0, "parts": {}}
""")
    left = f"len(set(os.listdir('/tmp')) - set({KEPT!r}))"
    out = run(f"import os\nprint(f\"left={{{left}}} two={{len('ab')}}\")")
    assert out.number("left") == 0 and out.number("two") == 2, out


def unprivileged(run: Run, h: Host, p: Pools, kind: str) -> None:
    """The ground the other cases stand on: a uid that is not root (one of the child's own
    under a root service, the pod's under the pod's server), no /proc, a PID namespace
    of its own."""
    out = run("""
import os
print(f"uid={os.getuid()} gid={os.getgid()} groups={len(os.getgroups())}")
print(f"proc={int(os.path.exists('/proc/self'))} ppid={os.getppid()}")
""")
    if p.mode == "pod":
        assert out.number("uid") == POD_UID, out
    else:
        assert out.number("uid") >= UID_BASE, out
    assert out.number("gid") == out.number("uid"), out
    assert out.number("groups") == 0 and out.number("proc") == 0, out
    assert out.number("ppid") < 10, out  # the zygote, low in a namespace of its own


# ── one call against another: what a call can learn of, or leave to, the calls after ──
# Run inside a call: `found(needle)` counts the strings of an earlier call (`needle`
# followed by 16 hex digits) it can reach by walking its inherited frames and the
# garbage collector's objects, and by reading its own memory page by page around the
# heap, the object arenas and the mmap region (write(2) to a pipe reads a page, EFAULT
# where none is mapped: no segfault on a hole).
SCAN = r"""
import ctypes, gc, os, re, sys

def found(needle):
    pat = re.compile(re.escape(needle.encode()) + rb"[0-9a-f]{16}")
    spat = re.compile(re.escape(needle) + "[0-9a-f]{16}")
    hits = 0

    def has(v):
        if isinstance(v, str):
            return bool(spat.search(v))
        if isinstance(v, (bytes, bytearray)):
            return bool(pat.search(bytes(v)))
        if isinstance(v, (list, tuple)):
            return any(has(x) for x in v[:1000] if isinstance(x, (str, bytes, list, tuple)))
        if isinstance(v, dict):
            return any(has(x) for x in list(v.values())[:1000] if isinstance(x, (str, bytes)))
        return False

    f = sys._getframe()
    while f is not None:
        hits += sum(1 for v in list(f.f_locals.values()) if has(v))
        f = f.f_back
    for o in gc.get_objects():
        try:
            hits += has(o)
        except Exception:
            pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    libc.sbrk.restype = ctypes.c_void_p
    r, w = os.pipe()
    page = 4096
    big = ctypes.create_string_buffer(1 << 20)
    anchors = {id(object()), id(sys.modules), ctypes.addressof(big), libc.sbrk(0) or 0}
    seen = set()
    for anchor in anchors:
        base = (anchor // page) * page
        run = b""
        for addr in range(base - (16 << 20), base + (16 << 20), page):
            if addr in seen or addr <= 0:
                continue
            seen.add(addr)
            if libc.write(w, addr, page) == page:
                run += os.read(r, page)
                if len(run) < (1 << 20):
                    continue
            hits += len(pat.findall(run))
            run = run[-64:]
        hits += len(pat.findall(run))
    return hits
"""


def cross_call_memory(run: Run, h: Host, p: Pools, kind: str) -> None:
    """The issue's first route: an earlier call's program and answer, read by a later call
    in what its process inherited (frames, objects, memory)."""
    mark = f"xcall{h.token}"
    secret = token_hex(8)
    first = run(f"print('{mark}' + '-A-' + '{secret}')")
    assert f"{mark}-A-{secret}" in first.text or kind == "reward", first
    out = run(SCAN + f"print(f\"found={{found('{mark}' + '-A-')}}\")")
    assert out.number("found") == 0, out


def ipc(run: Run, h: Host, p: Pools, kind: str) -> None:
    """SysV shared memory, message queues and semaphores, POSIX shared memory and message
    queues made by one call: refused (they hold memory no rlimit counts: seccomp.py),
    and were one made, gone for the next (and their memory with them)."""
    key = 0x5EED0000 + random.randrange(1 << 16)
    name = f"/fw{h.token}"
    made = run(f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
made = 0
made += libc.shmget({key}, 1 << 20, 0o1666) >= 0
made += libc.msgget({key}, 0o1666) >= 0
made += libc.semget({key}, 1, 0o1666) >= 0
try:
    from multiprocessing import shared_memory
    shared_memory.SharedMemory({name!r}, create=True, size=4096)
    made += 1
except Exception as e:
    print("shm_open refused", e)
q = rt.mq_open({name.encode()!r}, os.O_CREAT | os.O_RDWR, 0o666, None)
made += q >= 0
print(f"made={{made}}")
""")
    out = run(f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
found = {{
    "shm": libc.shmget({key}, 0, 0) >= 0,
    "msg": libc.msgget({key}, 0) >= 0,
    "sem": libc.semget({key}, 0, 0) >= 0,
    "posixshm": os.path.exists("/dev/shm{name}"),
    "mqueue": rt.mq_open({name.encode()!r}, os.O_RDWR) >= 0,
}}
print(" ".join(f"{{k}}={{int(v)}}" for k, v in found.items()), f"left={{sum(found.values())}}")
""")
    assert made.number("made") == 0, made
    assert out.number("left") == 0, out


def tmp_wipe_bypass(run: Run, h: Host, p: Pools, kind: str) -> None:
    """Hundreds of nested folders (past the wiper's file-descriptor limit), one locked,
    with a file at the bottom: the next call sees an empty /tmp, and does not pay for
    the chain."""
    run("""
import os
os.chdir("/tmp")
for i in range(600):
    os.mkdir("d")
    os.chdir("d")
open("bottom", "w").write("left for the next call")
os.chdir("/tmp/d/d/d")
os.chmod("/tmp/d/d", 0o500)
print("nested=600")
""")
    t0 = time.monotonic()
    left = f"len(set(os.listdir('/tmp')) - set({KEPT!r}))"
    out = run(f'import os\nprint(f"left={{{left}}}")')
    assert out.number("left") == 0, out
    t1 = time.monotonic()
    assert run("print('again=1')").number("again") == 1
    assert time.monotonic() - t1 < 0.3 + (t1 - t0), "a later call pays for the chain"


def zombies(run: Run, h: Host, p: Pools, kind: str) -> None:
    """Children made with clone(CLONE_PARENT) are the zygote's: it reaps them, and the
    calls after still start threads and processes."""
    out = run("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_PARENT, SIGCHLD = 0x8000, 17
n = 0
for _ in range(40):
    pid = libc.syscall(56, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    n += pid > 0
print(f"cloned={n}")
""")
    assert out.number("cloned") > 0 or kind == "reward", out
    for _ in range(3):
        out = run("""
import subprocess, threading
t = threading.Thread(target=lambda: None)
t.start()
t.join()
print(f"sub={subprocess.run(['true']).returncode + 1} thread=1")
""")
        assert out.number("sub") == 1 and out.number("thread") == 1, out


def sockets_in_bound_folders(run: Run, h: Host, p: Pools, kind: str) -> None:
    """A unix socket in a folder bound into the sandbox (read-only binds do not stop
    connect()): refused."""
    path = REPO / "tests" / f".s{h.token}"
    s = h.listener(socket.SOCK_STREAM, str(path), socket.AF_UNIX)
    path.chmod(0o777)  # a socket anyone may connect to (a service's, a docker.sock)
    try:
        out = run(f"""
import socket
try:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect({str(path)!r})
    c.sendall(b"escaped")
    print("connected=1")
except OSError as e:
    print("connected=0", e)
""")
        h.heard_nothing(s)
        assert out.number("connected") == 0, out
    finally:
        path.unlink(missing_ok=True)


def asyncio_still_runs(run: Run, h: Host, p: Pools, kind: str) -> None:
    """What the unix-socket refusal must leave: socketpair, which asyncio's loop uses."""
    out = run("import asyncio\nprint(f'ran={asyncio.run(asyncio.sleep(0, 7))}')")
    assert out.number("ran") == 7, out


# Run in a call: the metadata of every place a call might write (the sandbox's /tmp, the
# directories kept in it, and places that must be read-only), and which are writable
# (probed after the metadata is read: the probe's own file changes the times).
PLACES = ["/", "/tmp", "/dev", "/dev/shm", "/usr", "/etc", "/var", "/var/tmp", "/run",
          "/home", "/root", "/opt", str(REPO), str(REPO / "tests")]  # fmt: skip
PLACES += [f"/tmp/{k}" for k in KEPT]
METADATA = f"""
import os, zlib
PLACES = {PLACES!r}
for i, path in enumerate(PLACES):
    try:
        st = os.lstat(path)
    except OSError:
        print(f"exists_{{i}}=0")
        continue
    try:
        xattrs = sorted((n, os.getxattr(path, n)) for n in os.listxattr(path))
    except OSError as e:
        xattrs = [("error", str(e.errno).encode())]
    meta = (st.st_mode, st.st_uid, st.st_gid, xattrs)
    print(f"exists_{{i}}=1 meta_{{i}}={{zlib.crc32(repr(meta).encode())}}")
    for t in ("mtime", "ctime", "atime"):
        print(f"{{t}}_{{i}}={{getattr(st, f'st_{{t}}_ns') // 1_000_000}}")
    entries = len(os.listdir(path)) if os.access(path, os.R_OK | os.X_OK) else -1
    print(f"entries_{{i}}={{entries}}")
for i, path in enumerate(PLACES):
    try:
        with open(os.path.join(path, ".probe"), "w") as f:
            f.write("x")
        print(f"writable_{{i}}=1")
    except OSError:
        print(f"writable_{{i}}=0")
"""


def plant(chmod: bool) -> str:
    """Run in a call: change what it can of each place's own metadata (an extended
    attribute, its times, a file in it, and last, with `chmod`, its mode to 0)."""
    return f"""
import os, struct
PLACES = {PLACES!r}
NONE = 0xFFFFFFFF  # an ACL entry without an id
ACL = struct.pack("<I", 2) + b"".join(  # user:<this uid>:rwx, an ACL the owner may set
    struct.pack("<HHI", *e)
    for e in [(1, 7, NONE), (2, 7, os.getuid()), (4, 5, NONE), (0x10, 7, NONE), (0x20, 5, NONE)]
)
for i, path in enumerate(PLACES):
    done = 0
    for step in (
        lambda: os.setxattr(path, "user.fw", b"planted"),
        lambda: os.setxattr(path, "system.posix_acl_access", ACL),
        lambda: os.utime(path, (1234567, 1234567)),
        lambda: open(os.path.join(path, "plant"), "w").write("left"),
        lambda: os.chown(path, -1, os.getgid()),
    ):
        try:
            step()
            done += 1
        except OSError:
            pass
    print(f"done_{{i}}={{done}}")
if {chmod!r}:
    for i, path in enumerate(PLACES):
        try:
            os.chmod(path, 0)
            print(f"chmod_{{i}}=1")
        except OSError:
            print(f"chmod_{{i}}=0")
print("planted=1")
"""


def tmp_metadata(run: Run, h: Host, p: Pools, kind: str) -> None:
    """What a call can change of /tmp itself (and of any other place it can write), not
    only of what is in it: an extended attribute, an ACL, its times, the moment it
    wrote a file there, its mode (0: unreadable, which must not make it unwipable),
    its owner. The next call finds each place as the one before found it, with times
    no older than its own start, and every call is answered."""
    before = run(METADATA)
    for chmod in (False, True):
        planted = run(plant(chmod))
        assert planted.error is None and planted.number("planted") == 1, planted
        assert planted.number(f"done_{PLACES.index('/tmp')}") >= 1, planted  # a file at least
        time.sleep(0.2)  # the host's clock moves on: times older than `started` are carried
        started = time.time()
        after = run(METADATA)
        assert after.error is None, after
        for i, place in enumerate(PLACES):
            if not before.number(f"exists_{i}"):
                continue
            assert after.number(f"meta_{i}") == before.number(f"meta_{i}"), (place, after)
            if after.number(f"writable_{i}"):
                assert place == "/tmp" or place.startswith("/tmp/"), (place, after)
                # (only here: the host's own places, the repository, change under other tests)
                assert after.number(f"entries_{i}") == before.number(f"entries_{i}"), after
                for t in ("mtime", "ctime", "atime"):
                    assert after.number(f"{t}_{i}") >= (started - 0.01) * 1000, (place, t, after)


def memory_outside_rlimits(run: Run, h: Host, p: Pools, kind: str) -> None:
    """Memory no process's RLIMIT_AS counts: a memfd filled with write(2) (the pages stay
    while the fd is open, mapped by no one), a SysV segment detached after filling.
    Refused, so without a cgroup a call holds no more than its processes' rlimits."""
    out = run("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
held = 0
try:
    fd = os.memfd_create("hold")
    for _ in range(64):
        held += os.write(fd, b"x" * (1 << 20))
except OSError as e:
    print(f"memfd_errno={e.errno}")
print(f"memfd_held={held}")
print(f"shm={libc.shmget(0, 64 << 20, 0o1600)}")
""")
    assert out.number("memfd_held") == 0 and out.number("memfd_errno") == errno.EPERM, out
    assert out.number("shm") == -1, out


CASES = [
    unprivileged,
    fork_exec_shell,
    subprocess_shell,
    write_anywhere,
    read_host_files,
    environment,
    proc_tricks,
    tcp_connect,
    udp_sendmsg,
    dns,
    unix_sockets,
    ctypes_libc,
    namespaces_and_ptrace,
    kill_the_parent,
    fork_bomb,
    process_limit,
    exceed_file_size,
    outlive_the_call,
    outlive_the_timeout,
    forge_the_answer,
    memory,
    leftovers,
    cross_call_memory,
    ipc,
    tmp_wipe_bypass,
    zombies,
    sockets_in_bound_folders,
    asyncio_still_runs,
    tmp_metadata,
    memory_outside_rlimits,
]


def _host_ip() -> str:
    """This host's address on its network (not loopback), or loopback if it has none."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["tool", "reward"])
@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_escape_is_refused(case: Callable[..., None], kind: str, pools: Pools, host: Host) -> None:
    case(lambda code: pools.run(kind, code), host, pools, kind)


@pytest.mark.parametrize("kind", ["tool", "reward"])
def test_after_a_cancelled_call_every_call_gets_its_own_answer(pools: Pools, kind: str) -> None:
    """A caller that gives up on a call (a rollout cancelled mid-episode) must not leave
    that call's answer to be read as the next one's: the next 100 calls each get theirs."""
    parts = [as_fields(CustomReward(fn=REWARD, name="run"))]

    async def one(code: str) -> str:
        if kind == "tool":
            return (await pools.tool.run(CALL, PY, SEATBELT + code)).text
        r = await pools.verifier.call(SCORE, parts, SEATBELT + code, None, {})
        return f"n={int(r.parts.get('run.n', -1))}\n"

    async def body() -> list[str]:
        slow = asyncio.ensure_future(one("import time\ntime.sleep(1)\nprint('n=999')"))
        await asyncio.sleep(0.3)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return [await one(f"print('n={i}')") for i in range(100)]

    assert pools.loop.run_until_complete(body()) == [f"n={i}\n" for i in range(100)]


def test_a_completion_cannot_change_its_siblings_rewards(pools: Pools) -> None:
    """A group of 8 scored in one round trip, one of them trying every way to raise the
    others' rewards (patching the reward and the code runner, a file in /tmp, the
    environment) and to read their text: each sibling scores exactly as alone."""
    parts = [as_fields(CustomReward(fn=f"{REWARD.partition(':')[0]}:scored_code", name="s"))]
    tok = token_hex(4)
    attacker = (
        SEATBELT
        + SCAN
        + f"""
import os, sys
import services.tasks.rewards as R
import services.tasks.tools as T
fx = sys.modules["{REWARD.partition(":")[0]}"]
fx.run_python = lambda code: "score=1"
T.run_python = lambda code: "score=1"
R.score = lambda *a, **k: {{"reward": 1.0, "parts": {{}}}}
open("/tmp/score", "w").write("1")
os.environ["SCORE"] = "1"
print(f"score=0 seen={{found('sib{tok}' + '-S-')}}")
"""
    )
    honest = (
        SEATBELT
        + """
import os
mark = "sib{tok}-S-{hex}"
score = open("/tmp/score").read() if os.path.exists("/tmp/score") else os.environ.get("SCORE", "0")
print(f"score={{score}}")
"""
    )
    group = [attacker] + [honest.format(tok=tok, hex=token_hex(8)) for _ in range(7)]

    async def body() -> tuple[list[Any], list[Any]]:
        alone = [await pools.verifier.call(SCORE, parts, c, None, {}) for c in group]
        together = await pools.verifier.call_many(SCORE, [(parts, c, None, {}) for c in group])
        return alone, together

    alone, together = pools.loop.run_until_complete(body())
    assert [r.reward for r in alone] == [0.0] * 8, alone
    assert together == alone
    assert together[0].parts.get("s.seen") == 0.0, together[0]


def test_a_tools_secret_reaches_only_its_own_calls(pools: Pools) -> None:
    """A function tool's `env` (an API key) reaches that tool's calls, and no python-tool
    call of the same pool, before or after it, by any route above."""
    from services.tasks.episode_spec import FunctionTool

    tok = token_hex(4)
    key = f"tk{tok}-K-{token_hex(8)}"
    tool = FunctionTool.model_validate({
        "type": "function", "tag": "key", "fn": f"{REWARD.partition(':')[0]}:secret_tool",
        "parameters": {"name": {"type": "string"}}, "env": {"FW_TOOL_KEY": key},
    }).model_dump(mode="json")  # fmt: skip
    probe = (
        SEATBELT
        + SCAN
        + f"""
import os
print(f"found={{found('tk{tok}' + '-K-') + ('FW_TOOL_KEY' in os.environ)}}")
"""
    )

    async def body() -> list[str]:
        async with ToolPool(
            1, 10.0, tools=[PY, tool], sandbox=CONFINED, remote=pools.remote
        ) as pool:
            assert pool.confined
            before = await pool.run(CALL, PY, probe)
            own = await pool.run(CALL, tool, '{"name": "FW_TOOL_KEY"}')
            after = await pool.run(CALL, PY, probe)
            return [before.text, own.text, after.text]

    before, own, after = pools.loop.run_until_complete(body())
    assert own == f"FW_TOOL_KEY={key}", own
    assert before == "found=0\n" and after == "found=0\n", (before, after)


def test_a_calls_processes_share_one_memory_limit(pools: Pools) -> None:
    """Six processes of one call each fill 150 MB (each under its own RLIMIT_AS): where the
    host delegates cgroups, together they stay under the child's one limit (the tool
    pool's 512 MB), so at most three of them are alive with their 150 MB at once (the
    kernel kills one to let another fill: how many ever filled depends on which it
    picks, how many are alive does not). Elsewhere the limit is per process
    (jail.memory_mode) and this is skipped, saying so."""
    memory_mode = pools.memory_mode()
    if not memory_mode.startswith("cgroup"):
        pytest.skip(f"no cgroup is delegated here: {memory_mode}")
    out = pools.run(
        "tool",
        """
import os, select, time
r, w = os.pipe()
pids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        try:
            x = b"\\1" * (150 << 20)
            os.write(w, b"1")
            time.sleep(30)
        finally:
            os._exit(0)
    pids.append(pid)
os.close(w)
done, deadline = 0, time.monotonic() + 4
while done < 6 and time.monotonic() < deadline:
    if select.select([r], [], [], max(0, deadline - time.monotonic()))[0]:
        got = os.read(r, 16)
        if not got:
            break
        done += len(got)
alive = sum(os.waitpid(p, os.WNOHANG) == (0, 0) for p in pids)
print(f"filled={done} alive={alive}")
""",
    )
    assert out.number("filled") > 0 and 0 < out.number("alive") <= 3, out

"""Run verifiers and tools in sandboxed processes that can be killed: one bad sample
never stalls a worker, and nothing it runs reaches past its sandbox.

A verifier is named by import path, "pkg.module:function", and called as
`function(*args)` in a child process. The parent waits on the child's pipe
with an asyncio deadline. On timeout the child is killed (SIGKILL: a
verifier stuck in C code ignores everything else) and replaced; a raising
verifier is reported by the child; a call that dies mid-way is reported as
crashed. Each of these gives reward 0 and a counted, named error, and the
caller carries on — a thread-based `wait_for` could not stop a hung
pure-Python or C loop, which is why this is a process.

Children are started by jail.py: inside bubblewrap (their own PID and
network namespaces, a read-only root with only the interpreter and the
code they run, a private /tmp, an empty environment, a uid of their own,
rlimits, seccomp), or where the host has no sandbox and the run file allows
it, as plain processes with the same limits. Killing a child on a time-out
kills everything it started: the whole PID namespace (or process group).

Each child is a warm *zygote*: it imports the rewards and tools once
(`ZYGOTE_MODULES`, then the pool's `PRELOAD` and `warmup`, all before it
serves: none of it counts against a call's time limit), and then forks a
fresh process for every request, which runs the call and exits; the zygote
itself never runs a request's code. So a call
that monkeypatches a reward, leaves a background process or a file in /tmp,
or crashes, affects nothing after it: the zygote kills what the call left
(everything else in its PID namespace) and empties /tmp before answering.
A fork, and the copy-on-write faults of the call in it, cost milliseconds
of CPU (bench/results_sandbox.md); a group's completions share one
(`call_many`: one request). Requests that run only Flywheel's own code
reading the completion as text — the built-in rewards but math, the
calculator — are answered by the zygote itself (`_pure`), as before the
sandbox: they cannot run the completion as code.

The protocol is length-prefixed MessagePack on the child's stdin/stdout — no
pickle, and no fork of a parent that runs an event loop, NATS and torch
threads. Request `[path, args]`; answer `["ok", reward, parts]` or
`["error", message]`. Request `[path, args, "value"]` (a tool call) answers
`["value", text]`. Request `[path, [args, ...], "many"]` (a group's
completions) answers `["many", [answer, ...]]`, one `["ok", ...]` or
`["error", ...]` per call: one pipe round trip per group instead of per
completion, which at k = 1 was the rollout worker's largest cost outside the
engine's HTTP (bench/results_cpu.md). Request `[path, args, "warm"]` runs in
the zygote itself (warm-up: imports, caches). A call whose process died
without answering answers `["crashed", why]`. What a call's process sends
back is checked before it is passed on: a call cannot answer for another.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import signal
import struct
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, Self

import msgpack

from services.runtime.errors import ConfigError
from services.tasks import jail
from services.tasks.calls import Reward, environment, resolve, to_reward
from services.tasks.jail import Limits, Sandbox, Spawn

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a call's answer larger than this is refused


def _read_frame(stream: BinaryIO) -> Any:
    header = stream.read(_LEN.size)
    if len(header) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(header)
    return msgpack.unpackb(stream.read(n), raw=False)


def _frame(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(data)) + data


# ── the child (the zygote and the process it forks per request) ──────────────
_DENIED_EVENTS = (
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.fork",
    "os.forkpty",
    "ctypes.dlopen",
    "ctypes.cdata",
)


def audit_hook() -> None:
    """Plain processes only (no sandbox on this host, `insecure-allow`): refuse sockets,
    processes and ctypes from Python. A guard, not a wall: C code steps around it."""

    def hook(event: str, _args: tuple[Any, ...]) -> None:
        if event in _DENIED_EVENTS:
            raise PermissionError(f"{event} is not allowed in the tool sandbox")

    sys.addaudithook(hook)


@dataclass(frozen=True)
class _Options:
    memory_mb: int = 0
    nproc: int = 0
    fsize_mb: int = 0
    nofile: int = 0
    cpu_s: int = 0
    pidns: bool = False  # alone in a PID namespace: every other process there is a call's
    audit: bool = False
    uid: int = -1  # plain processes of a root service: the uid calls run as

    @classmethod
    def parse(cls, argv: Sequence[str]) -> _Options:
        kw: dict[str, Any] = {}
        names = {"memory": "memory_mb", "nproc": "nproc", "fsize": "fsize_mb"}
        names |= {"nofile": "nofile", "cpu": "cpu_s", "uid": "uid"}
        for a in argv:
            key, _, value = a.removeprefix("--").partition("=")
            if key in names:
                kw[names[key]] = int(value)
            elif key in ("pidns", "audit"):
                kw[key] = True
            else:
                raise SystemExit(f"sandbox child: unknown option {a!r}")
        return cls(**kw)


def _limit(which: int, value: int) -> None:
    import resource

    if value > 0:
        resource.setrlimit(which, (value, value))


def _harden(opts: _Options) -> None:
    """The zygote's own limits, before it imports anything it is asked to: no fd of the
    parent's but its pipes, rlimits its calls inherit, and not dumpable (a call's
    process, same uid, cannot ptrace it or open its /proc files)."""
    import ctypes
    import resource

    os.closerange(3, 1 << 16)
    _limit(resource.RLIMIT_AS, opts.memory_mb << 20)
    _limit(resource.RLIMIT_NPROC, opts.nproc)
    _limit(resource.RLIMIT_FSIZE, opts.fsize_mb << 20)
    _limit(resource.RLIMIT_NOFILE, opts.nofile)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    pr_set_dumpable = 4
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)


def _drop_root(uid: int) -> None:
    """Plain processes of a root service: become `uid`, no groups, no capabilities, for
    good (after the warm-up, before the first call)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def _enter_call(opts: _Options) -> None:
    """In the forked process, before the call: no pipe of the zygote's (it could forge
    another call's answer), a CPU limit, the audit hook where there are no walls."""
    import resource

    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    if opts.cpu_s > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (opts.cpu_s, opts.cpu_s + 1))
    if opts.audit:
        audit_hook()


def _verdict(fn: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    """["ok", reward, parts] of one call, or ["error", message] if it raised."""
    try:
        r = to_reward(fn(*args))
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
        return ["error", f"{type(e).__name__}: {e}"]
    return ["ok", r.reward, r.parts]


def _answer(fn: Callable[..., Any], args: Sequence[Any], mode: str | None) -> list[Any]:
    try:
        if mode == "value":
            return ["value", str(fn(*args))]
        if mode == "many":
            return ["many", [_verdict(fn, a) for a in args]]
        return _verdict(fn, args)
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
        return ["error", f"{type(e).__name__}: {e}"]


def _is_verdict(v: Any) -> bool:
    if not isinstance(v, list) or not v:
        return False
    if v[0] == "error":
        return len(v) == 2 and isinstance(v[1], str)
    return (
        v[0] == "ok"
        and len(v) == 3
        and isinstance(v[1], float)
        and math.isfinite(v[1])
        and isinstance(v[2], dict)
        and all(isinstance(k, str) and isinstance(x, float) for k, x in v[2].items())
    )


def checked(answer: Any, mode: str | None, n: int) -> list[Any]:
    """A call's answer if it has the shape its request asks for, else an error: what a
    call's process sends is not trusted (its code may be the policy's)."""
    ok = False
    if isinstance(answer, list) and answer and answer[0] == "error":
        ok = _is_verdict(answer)
    elif mode == "value":
        ok = isinstance(answer, list) and len(answer) == 2 and answer[0] == "value"
        ok = ok and isinstance(answer[1], str)
    elif mode == "many":
        ok = isinstance(answer, list) and len(answer) == 2 and answer[0] == "many"
        ok = ok and isinstance(answer[1], list) and len(answer[1]) == n
        ok = ok and all(_is_verdict(v) for v in answer[1])
    else:
        ok = _is_verdict(answer)
    return answer if ok else ["error", "sandbox: the call sent back a malformed answer"]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n > 0:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _read_answer(fd: int) -> Any:
    header = _read_exact(fd, _LEN.size)
    if header is None:
        return None
    (n,) = _LEN.unpack(header)
    body = _read_exact(fd, n) if n <= MAX_FRAME else None
    if body is None:
        return None
    try:
        return msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.ExtraData) as e:
        return ["error", f"sandbox: the call sent back bytes that do not decode: {e}"]


def _fork() -> int:
    """os.fork, waiting out a moment of EAGAIN (the last call's processes still being reaped
    count against RLIMIT_NPROC)."""
    for _ in range(100):
        try:
            return os.fork()
        except BlockingIOError:
            time.sleep(0.01)
    return os.fork()


def _died(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by {signal.strsignal(sig) or sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _clean_up(pid: int, opts: _Options, keep: set[str]) -> str:
    """After a call: kill its process and all it started, reap it, empty the temp dir.
    How it ended, for a call that did not answer."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if opts.pidns:  # everything here but this process (and bubblewrap's init) is the call's
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
    _empty(os.getcwd(), keep)
    return _died(status)


def _keep(root: str) -> set[str]:
    """What is in `root` before any call: the mount points of what is bound below /tmp and
    the directories that lead to them (not entered: another filesystem)."""
    keep: set[str] = set()
    dev = os.stat(root).st_dev
    with os.scandir(root) as entries:
        for e in entries:
            keep.add(e.path)
            if e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_dev == dev:
                keep |= _keep(e.path)
    return keep


def _empty(path: str, keep: set[str]) -> None:
    """Remove what a call left in `path` (all but `keep`), directories it made unreadable
    included: the next call must not see it."""
    import shutil

    def unlock(_fn: Any, p: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        with contextlib.suppress(OSError):
            (shutil.rmtree if os.path.isdir(p) and not os.path.islink(p) else os.unlink)(p)

    with os.scandir(path) as entries:
        for e in entries:
            if e.path in keep:
                if e.is_dir(follow_symlinks=False) and any(
                    k.startswith(e.path + "/") for k in keep
                ):
                    _empty(e.path, keep)
            elif e.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.chmod(e.path, 0o700)
                shutil.rmtree(e.path, onerror=unlock)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)


def _isolated(
    fn: Callable[..., Any], args: Sequence[Any], mode: str | None, o: _Options, keep: set[str]
) -> Any:
    """Run one request in a forked process; its checked answer (or why it gave none)."""
    r, w = os.pipe()
    try:
        pid = _fork()
    except OSError as e:
        os.close(r)
        os.close(w)
        return ["crashed", f"no process for the call: {e}"]
    if pid == 0:  # the call's process: answer once, exit whatever happens
        try:
            os.close(r)
            _enter_call(o)
            data = memoryview(_frame(_answer(fn, args, mode)))
            while data:
                data = data[os.write(w, data) :]
        finally:
            os._exit(0)
    os.close(w)
    try:
        answer = _read_answer(r)
    finally:
        os.close(r)
        how = _clean_up(pid, o, keep)
    if answer is None:
        return ["crashed", f"its process {how} without answering"]
    return checked(answer, mode, len(args))


def _pure(path: str, args: Sequence[Any], mode: str | None) -> bool:
    """A request that runs only Flywheel's code reading the completion as text (built-in
    rewards but math, the calculator): answered in the zygote, at the cost of the design
    before the sandbox. Anything that may run the completion as code, or the user's
    code, gets its own process."""
    from services.tasks import rewards, tools

    try:
        if path == rewards.SCORE and mode in (None, "many"):
            calls = args if mode == "many" else [args]
            return all(rewards.pure(c[0]) for c in calls)
        if path == tools.CALL and mode == "value":
            return tools.pure(args[0])
    except (IndexError, TypeError, KeyError):
        return False  # not the shape these take: not pure
    return False


def preload(modules: list[str]) -> float:
    """A child's first request (in the zygote): import `modules` (VerifierPool.PRELOAD).
    Its answer also says the child is up: its interpreter started, its imports done."""
    for module in modules:
        importlib.import_module(module)
    return 1.0


_PRELOAD = "services.tasks.sandbox:preload"
# The zygote's own imports (`_pure` reads both), before it serves: each call's fork
# starts with them warm.
ZYGOTE_MODULES = ("services.tasks.rewards", "services.tasks.tools")


def _child_main(argv: Sequence[str]) -> None:
    """The zygote: read [path, args(, mode)], answer each in a process of its own
    (in itself: warm-up); see the module docstring for the frames."""
    opts = _Options.parse(argv)
    _harden(opts)
    for module in ZYGOTE_MODULES:
        importlib.import_module(module)
    cache: dict[str, Callable[..., Any]] = {}
    keep = _keep(os.getcwd())  # the temp dir as it is before any call
    out = sys.stdout.buffer
    while True:
        try:
            path, args, *rest = _read_frame(sys.stdin.buffer)
        except EOFError:
            return
        mode = rest[0] if rest else None
        try:  # importing here (the service names the path, not the policy): warm for forks
            fn = cache.get(path) or cache.setdefault(path, resolve(path))
        except Exception as e:  # noqa: BLE001 -- a module that fails to import: reported
            answer: Any = ["error", f"{type(e).__name__}: {e}"]
        else:
            if mode == "warm":
                answer = _answer(fn, args, None)
            elif _pure(path, args, mode):
                answer = _answer(fn, args, mode)
            else:
                if opts.uid >= 0:
                    _drop_root(opts.uid)
                answer = _isolated(fn, args, mode, opts, keep)
        out.write(_frame(answer))
        out.flush()


# ── the pools (in the service) ───────────────────────────────────────────────
class _Child:
    """One sandboxed zygote and the two ends of its pipe (its stdin/stdout here, or a
    connection to the `flywheel sandbox` server that started it there)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        confined: bool,
        stop: Callable[[], Awaitable[None]],
        pid: int | None = None,
    ) -> None:
        self.reader, self.writer, self.confined = reader, writer, confined
        self._stop = stop
        self.pid = pid  # the process this service started (None: the server's)

    @classmethod
    async def start(cls, spawn: Spawn) -> _Child:
        """A child of this process."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *spawn.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=spawn.env,
                cwd=spawn.cwd,
                pass_fds=spawn.pass_fds,
                # plain processes: a group of their own, killed whole on a time-out
                start_new_session=not spawn.confined,
            )
        finally:
            spawn.close_fds()
        assert proc.stdin is not None and proc.stdout is not None

        async def stop() -> None:
            """Kill the child and everything it started: bubblewrap's death ends its PID
            namespace; plain processes die as a process group."""
            with contextlib.suppress(ProcessLookupError):
                if spawn.confined:
                    proc.kill()
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            spawn.cleanup()

        return cls(proc.stdout, proc.stdin, spawn.confined, stop, proc.pid)

    @classmethod
    async def connect(cls, socket_path: str, sandbox: Sandbox, cpu_s: int) -> _Child:
        """A child of the `flywheel sandbox` server on `socket_path` (services/sandbox):
        it starts one for this connection and kills it when the connection closes."""
        try:
            reader, writer = await asyncio.open_unix_connection(socket_path)
        except OSError as e:
            raise ConfigError(f"sandbox server {socket_path}: cannot connect: {e}") from e
        writer.write(_frame(["spawn", {**sandbox.to_wire(), "cpu_s": cpu_s}]))
        await writer.drain()
        try:
            header = await reader.readexactly(_LEN.size)
            answer = msgpack.unpackb(await reader.readexactly(_LEN.unpack(header)[0]))
        except asyncio.IncompleteReadError as e:
            writer.close()
            raise ConfigError(f"sandbox server {socket_path} closed the connection") from e
        if answer[0] != "ready":
            writer.close()
            raise ConfigError(f"sandbox server {socket_path}: {answer[1]}")

        async def stop() -> None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

        return cls(reader, writer, bool(answer[1]), stop)

    async def roundtrip(self, path: str, args: tuple[Any, ...], mode: str | None = None) -> Any:
        self.writer.write(_frame([path, list(args), *([mode] if mode else [])]))
        await self.writer.drain()
        try:
            header = await self.reader.readexactly(_LEN.size)
            body = await self.reader.readexactly(_LEN.unpack(header)[0])
        except asyncio.IncompleteReadError as e:
            raise EOFError("verifier process closed its pipe") from e
        return msgpack.unpackb(body, raw=False)

    async def kill(self) -> None:
        await self._stop()


class VerifierPool:
    """`size` verifier processes; `await pool.call(path, *args)` never hangs past the limit.

    `errors` counts failures by kind ("timeout", "raised", "crashed");
    `calls` counts every call. Use `async with VerifierPool(...) as pool`.

    `warmup`: calls every new child makes before it serves (import math-verify,
    build a reasoning-gym dataset: seconds, which must not count against the
    first real call's limit, or a slow import times out on every child it
    replaces). A warm-up that fails at start is a ConfigError. Before those,
    every child answers `preload` of `PRELOAD`, the reward entry point
    (pydantic and the reward classes: a tenth of a second of CPU, seconds on a
    loaded box): a child serves only once that answer is in, so neither its
    interpreter's start, nor bubblewrap's, nor an import ever counts against a
    call's time limit.

    `sandbox`: what the children may see and use (jail.py); by default only
    Flywheel's own code, and the sandbox is required. `remote`: the unix socket
    of a `flywheel sandbox` server that starts the children instead (a sidecar
    container without the service's credentials or volumes).
    """

    WARMUP_TIMEOUT_S = 120.0
    PRELOAD: tuple[str, ...] = ("services.tasks.rewards",)

    def __init__(
        self,
        size: int = 2,
        timeout_s: float = 5.0,
        warmup: Sequence[tuple[str, tuple[Any, ...]]] = (),
        sandbox: Sandbox | None = None,
        remote: str | os.PathLike[str] | None = None,
    ) -> None:
        if size < 1 or timeout_s <= 0:
            raise ConfigError("verifier pool needs size >= 1 and timeout_s > 0")
        self.size = size
        self.timeout_s = timeout_s
        self.warmup = tuple(warmup)
        self.sandbox = sandbox or Sandbox()
        self.remote = os.fspath(remote) if remote is not None else None
        self.confined: bool | None = None  # known at start: in the sandbox, or plain processes
        self.errors: Counter[str] = Counter()
        self.calls = 0
        self._idle: asyncio.Queue[_Child | None] | None = None
        self._all: list[_Child] = []

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        why = None
        if self.remote is None:  # (a server checks its own host, per child)
            why = await asyncio.to_thread(self.sandbox.check)  # ConfigError: must not run
        self._idle = asyncio.Queue()
        children = await asyncio.gather(*(self._spawn(strict=True) for _ in range(self.size)))
        for child in children:
            self._idle.put_nowait(child)
        self.confined = all(c.confined for c in children)
        if not self.confined:
            log.warning(
                "%s runs as plain processes (limits, no walls): the sandbox is unavailable%s",
                type(self).__name__,
                f" ({why})" if why else f" on the server at {self.remote}",
            )

    async def _spawn(self, strict: bool = False) -> _Child:
        cpu_s = math.ceil(self.timeout_s) + 1
        if self.remote is not None:
            child = await _Child.connect(self.remote, self.sandbox, cpu_s)
        else:
            child = await _Child.start(jail.plan(self.sandbox, cpu_s))
        self._all.append(child)
        # The preload first, even of nothing: the child is ready once it has answered.
        for path, args in [(_PRELOAD, (list(self.PRELOAD),)), *self.warmup]:
            try:
                answer = await asyncio.wait_for(
                    child.roundtrip(path, args, "warm"), self.WARMUP_TIMEOUT_S
                )
            except (TimeoutError, EOFError, OSError) as e:
                answer = ["error", f"{type(e).__name__}: {e}"]
            if answer[0] == "error":
                if strict:
                    await self.close()
                    raise ConfigError(f"verifier warm-up {path} failed: {answer[1]}")
                log.warning("verifier warm-up %s failed: %s", path, answer[1])
        return child

    async def _retire(self, child: _Child) -> _Child | None:
        await child.kill()
        self._all.remove(child)
        return await self._respawn()

    async def _respawn(self) -> _Child | None:
        """A new child, or None while none can start (a sandbox server restarting): the
        slot stays in the pool and the next call tries again."""
        try:
            return await self._spawn()
        except (ConfigError, OSError) as e:
            log.warning("sandbox: cannot start a process: %s", e)
            return None

    async def close(self) -> None:
        for child in list(self._all):
            await child.kill()
        self._all.clear()

    async def _exchange(
        self,
        path: str,
        args: tuple[Any, ...],
        limit: float,
        mode: str | None = None,
        count: bool = True,
    ) -> list[Any]:
        """One call in a child: its answer, or ["error", why] after a timeout or crash
        (counted in `errors` unless not `count`)."""
        if self._idle is None:
            raise RuntimeError(f"{type(self).__name__} used before start()")
        self.calls += count
        slot = await self._idle.get()
        child = slot if slot is not None else await self._respawn()
        if child is None:
            self._idle.put_nowait(None)
            self.errors["crashed"] += count
            return ["error", f"{path}: no sandbox process could start", "crashed"]
        try:
            answer: list[Any] = await asyncio.wait_for(child.roundtrip(path, args, mode), limit)
        except TimeoutError:
            if count:
                log.warning("sandbox: %s timed out after %.1fs; killing its process", path, limit)
            self.errors["timeout"] += count
            self._idle.put_nowait(await self._retire(child))
            return ["error", f"{path} timed out after {limit}s", "timeout"]
        except (EOFError, OSError, ConnectionError) as e:
            self.errors["crashed"] += count
            self._idle.put_nowait(await self._retire(child))
            return ["error", f"{path} process died: {e!r}", "crashed"]
        except BaseException:
            self._idle.put_nowait(child)  # cancelled mid-call: the child stays the pool's
            raise
        self._idle.put_nowait(child)
        if answer[0] == "crashed":
            self.errors["crashed"] += count
            return ["error", f"{path} process died: {answer[1]}", "crashed"]
        if answer[0] == "error":
            self.errors["raised"] += count
            return ["error", f"{path} raised {answer[1]}", "raised"]
        return answer

    @staticmethod
    def _reward(answer: list[Any]) -> Reward:
        if answer[0] == "error":
            return Reward(0.0, error=f"verifier {answer[1]}")
        return Reward(float(answer[1]), {str(k): float(v) for k, v in answer[2].items()})

    async def call(self, path: str, *args: Any, timeout_s: float | None = None) -> Reward:
        """Run `path(*args)` in a child; Reward(0, error=...) on timeout, raise or crash."""
        return self._reward(await self._exchange(path, args, timeout_s or self.timeout_s))

    async def call_many(
        self, path: str, calls: Sequence[tuple[Any, ...]], timeout_s: float | None = None
    ) -> list[Reward]:
        """`call(path, *args)` for each of `calls`, with the same results, in one round trip.

        The whole batch gets one call's limit. If it runs past it (a hang, or
        verifiers slow enough that the batch does) or the child dies, the calls
        run again one by one, each under its own limit, as `call` would: a bad
        completion costs at most one extra limit and still scores alone.
        """
        limit = timeout_s or self.timeout_s
        if len(calls) > 1:
            answer = await self._exchange(path, tuple(calls), limit, "many", count=False)
            if answer[0] == "many":
                self.calls += len(calls)
                return [self._reward(self._raised(path, v)) for v in answer[1]]
        return [await self.call(path, *args, timeout_s=limit) for args in calls]

    def _raised(self, path: str, verdict: list[Any]) -> list[Any]:
        """A batch's per-call verdict as `_exchange` words a raise (counted the same)."""
        if verdict[0] != "error":
            return verdict
        self.errors["raised"] += 1
        return ["error", f"{path} raised {verdict[1]}", "raised"]


@dataclass(frozen=True)
class ToolOutcome:
    """A tool call's text, or why it failed ("timeout", "raised", "crashed") and how long."""

    text: str
    error: str | None
    seconds: float


def tool_modules(tools: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The user modules function tools are imported from (visible in the sandbox)."""
    return tuple(str(t["fn"]).partition(":")[0] for t in tools if t.get("type") == "function")


class ToolPool(VerifierPool):
    """Sandboxed children that run tool calls (a process per call, `memory_mb` each).

    Apart from the verifiers: a tool's limits must not apply to a reward, and
    a hung tool must not hold a verifier's process.
    """

    PRELOAD = ()  # no reward runs here; its warm-up imports the tools

    def __init__(
        self,
        size: int = 2,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        tools: Sequence[dict[str, Any]] = (),
        sandbox: Sandbox | None = None,
        remote: str | os.PathLike[str] | None = None,
    ) -> None:
        # warm-up: import the tools module (and the user's tools) before the first call
        warm = ("services.tasks.tools:warm", (list(tools),))
        base = sandbox or Sandbox(modules=tool_modules(tools))
        box = replace(base, limits=replace(base.limits, memory_mb=memory_mb), audit=True)
        super().__init__(size, timeout_s, warmup=[warm], sandbox=box, remote=remote)

    async def run(self, path: str, *args: Any, timeout_s: float | None = None) -> ToolOutcome:
        """`path(*args)` as text; a hang, raise or crash is an outcome with its error."""
        started = time.monotonic()
        answer = await self._exchange(path, args, timeout_s or self.timeout_s, "value")
        seconds = time.monotonic() - started
        if answer[0] == "error":
            return ToolOutcome(str(answer[1]).removeprefix(f"{path} "), str(answer[2]), seconds)
        return ToolOutcome(str(answer[1]), None, seconds)


__all__ = [
    "Limits",
    "Reward",
    "Sandbox",
    "ToolOutcome",
    "ToolPool",
    "VerifierPool",
    "environment",
    "resolve",
    "to_reward",
]

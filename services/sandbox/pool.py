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
rlimits, seccomp, and a cgroup of their own where the host delegates one:
`jail.memory_mode`), or where the host has no sandbox and the run file allows
it, as plain processes with the same limits. Killing a child on a time-out
kills everything it started: the whole PID namespace (or process group).

The children are zygotes (zygote.py: a fork per call, nothing of one call left
for the next), spoken to in frames (protocol.py). This module is the service's
side: it starts them, sends each call with a fresh id, reads its answer under
an asyncio deadline, and replaces a child whose state is in doubt.

Which requests of a group may share one process is the code's own declaration:
a module whose functions only read a completion as text registers a predicate
(`text_reader`, e.g. tasks/rewards.py and tasks/tools.py); the pool knows no
reward or tool by name, and anything unregistered gets a process per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Self

import msgpack

from services.runtime.errors import ConfigError
from services.sandbox import jail
from services.sandbox.calls import Reward
from services.sandbox.jail import Sandbox, Spawn
from services.sandbox.protocol import HEADER, MAX_FRAME, PRELOAD_PATH, Desync, checked, encode

log = logging.getLogger(__name__)

# (path, mode) -> whether a request's first argument makes it a text reader
_TEXT_READERS: dict[tuple[str, str | None], Callable[[Any], bool]] = {}
# Modules every child imports before it serves, and the warm-ups of every tool pool:
# declared by the code they belong to, as it is imported (the pool knows no task).
_EVERY_CHILD: dict[str, None] = {}
_TOOL_WARMUPS: dict[str, None] = {}


def every_child_imports(module: str) -> None:
    """Declare that every sandbox child imports `module` before it serves (an entry
    point of what the pools run): each call's fork starts with it warm."""
    _EVERY_CHILD[module] = None


def tool_warmup(path: str) -> None:
    """Declare `path(tools)` the warm-up of every tool pool's children: called with the
    pool's tools by name only (their `type` and `fn`, never their `env`)."""
    _TOOL_WARMUPS[path] = None


def text_reader(path: str, mode: str | None, pure: Callable[[Any], bool]) -> None:
    """Declare that `path` called in `mode` (None: a reward, "value": a tool call) runs
    only Flywheel's code reading the completion as text when `pure(args[0])`: a group
    of such requests shares one process. Called where the function is defined."""
    _TEXT_READERS[(path, mode)] = pure


def _pure(path: str, args: Sequence[Any], mode: str | None) -> bool:
    """A request that runs only Flywheel's code reading the completion as text (built-in
    rewards but math, the calculator: what `text_reader` declared): a group of them
    shares one process (the pool decides, the zygote forks accordingly). Anything that
    may run the completion as code, or the user's code, gets a process of its own."""
    pure = _TEXT_READERS.get((path, mode))
    if pure is None:
        return False
    try:
        return pure(args[0])
    except (IndexError, TypeError, KeyError):
        return False  # not the shape these take: not pure


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
        writer.write(encode(["spawn", {**sandbox.to_wire(), "cpu_s": cpu_s}]))
        await writer.drain()
        try:
            header = await reader.readexactly(HEADER.size)
            answer = msgpack.unpackb(await reader.readexactly(HEADER.unpack(header)[0]))
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

    async def send(self, frames: Sequence[Any]) -> None:
        self.writer.write(b"".join(encode(f) for f in frames))
        await self.writer.drain()

    async def read(self) -> Any:
        """One frame; EOFError when the child is gone. A body that does not decode (a
        call's answer, spliced through as it wrote it) reads as None."""
        try:
            header = await self.reader.readexactly(HEADER.size)
            (n,) = HEADER.unpack(header)
            if n > MAX_FRAME:
                raise EOFError(f"a frame of {n} bytes")
            body = await self.reader.readexactly(n)
        except asyncio.IncompleteReadError as e:
            raise EOFError("verifier process closed its pipe") from e
        try:
            return msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.ExtraData):
            return None

    async def warm(self, path: str, args: tuple[Any, ...]) -> Any:
        """A warm-up request, answered by the zygote itself: its answer."""
        rid = secrets.randbits(62)
        await self.send([["warm", rid, path, list(args)]])
        frame = await self.read()
        if not (isinstance(frame, list) and len(frame) == 3 and frame[:2] == ["warmed", rid]):
            raise Desync(f"a warm-up answered {frame!r:.200}")
        return frame[2]

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
    every child answers `preload` of the modules every child imports
    (`every_child_imports`: the reward and tool entry points) and `PRELOAD`
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
    PRELOAD: tuple[str, ...] = ()  # this pool's own, beside `every_child_imports`

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
        self._killing: set[asyncio.Task[None]] = set()  # abandoned children being killed

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
        if self.remote is None:
            log.info("%s: memory per call: %s", type(self).__name__, jail.memory_mode())
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
        preload = list(dict.fromkeys([*_EVERY_CHILD, *self.PRELOAD]))
        for path, args in [(PRELOAD_PATH, (preload,)), *self.warmup]:
            try:
                answer = await asyncio.wait_for(child.warm(path, args), self.WARMUP_TIMEOUT_S)
            except (TimeoutError, EOFError, OSError, Desync) as e:
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

    def _abandon(self, child: _Child) -> None:
        """Kill `child` in the background and leave its slot empty (the next call starts a
        new one): a cancelled call's process may still answer, and its answer must never
        be read as another call's."""
        assert self._idle is not None
        self._all.remove(child)
        self._idle.put_nowait(None)
        task = asyncio.get_running_loop().create_task(child.kill())
        self._killing.add(task)
        task.add_done_callback(self._killing.discard)

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
        if self._killing:
            await asyncio.gather(*self._killing, return_exceptions=True)

    async def _batch(
        self, child: _Child, path: str, calls: Sequence[tuple[Any, ...]], mode: str | None
    ) -> tuple[list[list[Any]], str | None]:
        """Send `calls` as one request of a fresh id, read one answer per call (each from
        its own process, relayed by the zygote) and the zygote's closing frame. The
        answers, and why the slot is in doubt (None: it is not). Desync if the zygote's
        frames do not echo the id in order."""
        rid = secrets.randbits(62)
        n = len(calls)
        pure = all(_pure(path, args, mode) for args in calls)
        requests = [[rid, i, path, list(args), mode] for i, args in enumerate(calls)]
        await child.send([["calls", rid, n, pure], *requests])
        answers: list[list[Any]] = []
        doubts: list[str] = []
        while True:
            frame = await child.read()
            if not (isinstance(frame, list) and len(frame) >= 3 and frame[1] == rid):
                raise Desync(f"call {rid} was answered {frame!r:.200}")
            if frame[0] == "done" and len(answers) == n:
                doubts += [str(frame[2])] if frame[2] else []
                return answers, "; ".join(doubts) or None
            if frame[0] not in ("answer", "crashed") or frame[2] != len(answers):
                raise Desync(f"call {rid} was answered {frame!r:.200} after {len(answers)}")
            k = frame[3]
            if not (isinstance(k, int) and 0 < k <= n - len(answers)):
                raise Desync(f"call {rid} was answered for {k!r} requests")
            if frame[0] == "crashed":
                answers += [["crashed", str(frame[4])]] * k
                continue
            got = await child.read()
            if isinstance(got, list) and len(got) == 3 and got[:2] == [rid, frame[2]]:
                if isinstance(got[2], list) and len(got[2]) == k:
                    answers += [checked(a, mode) for a in got[2]]
                    continue
            answers += [["error", "sandbox: the call sent back a malformed answer"]] * k
            doubts.append("a call's process sent back a malformed answer")

    async def _run(
        self, path: str, calls: Sequence[tuple[Any, ...]], limit: float, mode: str | None
    ) -> list[list[Any]] | tuple[str, str]:
        """`calls` in a child, each in a process of its own: their answers, or (kind, why)
        when the child as a whole failed ("timeout", "crashed"; not counted here)."""
        if self._idle is None:
            raise RuntimeError(f"{type(self).__name__} used before start()")
        slot = await self._idle.get()
        try:
            child = slot if slot is not None else await self._respawn()
        except BaseException:  # cancelled while a new child started: the slot stays
            self._idle.put_nowait(None)
            raise
        if child is None:
            self._idle.put_nowait(None)
            return "crashed", f"{path}: no sandbox process could start"
        try:
            answers, doubt = await asyncio.wait_for(self._batch(child, path, calls, mode), limit)
        except TimeoutError:
            self._idle.put_nowait(await self._retire(child))
            return "timeout", f"{path} timed out after {limit}s"
        except (EOFError, OSError, ConnectionError, Desync) as e:
            self._idle.put_nowait(await self._retire(child))
            return "crashed", f"{path} process died: {e!r}"
        except BaseException:  # cancelled mid-call: never hand its answer to the next call
            self._abandon(child)
            raise
        if doubt is None:
            self._idle.put_nowait(child)
        else:  # a crash, processes left behind, a /tmp it could not empty: a new child
            log.info("sandbox: replacing a %s process: %s", type(self).__name__, doubt)
            self._idle.put_nowait(await self._retire(child))
        return answers

    def _counted(self, path: str, answer: list[Any]) -> list[Any]:
        """A call's answer as callers read it: ["error", why, kind] counted in `errors`."""
        if answer[0] == "crashed":
            self.errors["crashed"] += 1
            return ["error", f"{path} process died: {answer[1]}", "crashed"]
        if answer[0] == "error":
            self.errors["raised"] += 1
            return ["error", f"{path} raised {answer[1]}", "raised"]
        return answer

    async def _one(
        self, path: str, args: tuple[Any, ...], limit: float, mode: str | None
    ) -> list[Any]:
        """One call: its answer, or ["error", why, kind] after a timeout, raise or crash."""
        self.calls += 1
        out = await self._run(path, [args], limit, mode)
        if isinstance(out, tuple):
            kind, why = out
            if kind == "timeout":
                log.warning("sandbox: %s timed out after %.1fs; killing its process", path, limit)
            self.errors[kind] += 1
            return ["error", why, kind]
        return self._counted(path, out[0])

    @staticmethod
    def _reward(answer: list[Any]) -> Reward:
        if answer[0] == "error":  # no verdict: unscored, dead-lettered as verifier_<kind>
            kind = answer[2] if len(answer) > 2 else "raised"
            return Reward(0.0, error=f"verifier {answer[1]}", reason=f"verifier_{kind}")
        return Reward(float(answer[1]), {str(k): float(v) for k, v in answer[2].items()})

    async def call(self, path: str, *args: Any, timeout_s: float | None = None) -> Reward:
        """Run `path(*args)` in a child; Reward(0, error=...) on timeout, raise or crash."""
        return self._reward(await self._one(path, args, timeout_s or self.timeout_s, None))

    async def call_many(
        self, path: str, calls: Sequence[tuple[Any, ...]], timeout_s: float | None = None
    ) -> list[Reward]:
        """`call(path, *args)` for each of `calls`, with the same results, in one round trip:
        each in a process of its own (a completion cannot touch its siblings' rewards).

        The whole batch gets one call's limit. If it runs past it (a hang, or
        verifiers slow enough that the batch does) or the child dies, the calls
        run again one by one, each under its own limit, as `call` would: a bad
        completion costs at most one extra limit and still scores alone.
        """
        limit = timeout_s or self.timeout_s
        if len(calls) > 1:
            out = await self._run(path, calls, limit, None)
            if not isinstance(out, tuple):
                self.calls += len(calls)
                return [self._reward(self._counted(path, a)) for a in out]
        return [await self.call(path, *args, timeout_s=limit) for args in calls]


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

    def __init__(
        self,
        size: int = 2,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        tools: Sequence[dict[str, Any]] = (),
        sandbox: Sandbox | None = None,
        remote: str | os.PathLike[str] | None = None,
    ) -> None:
        # warm-up: import the tools module (and the user's tools) before the first call; only
        # their names: a tool's `env` (a secret) reaches no process but its own calls'
        names = [{"type": t.get("type"), "fn": t.get("fn")} for t in tools]
        warm = [(path, (names,)) for path in _TOOL_WARMUPS]
        base = sandbox or Sandbox(modules=tool_modules(tools))
        box = replace(base, limits=replace(base.limits, memory_mb=memory_mb), audit=True)
        super().__init__(size, timeout_s, warmup=warm, sandbox=box, remote=remote)

    async def run(self, path: str, *args: Any, timeout_s: float | None = None) -> ToolOutcome:
        """`path(*args)` as text; a hang, raise or crash is an outcome with its error."""
        started = time.monotonic()
        answer = await self._one(path, args, timeout_s or self.timeout_s, "value")
        seconds = time.monotonic() - started
        if answer[0] == "error":
            return ToolOutcome(str(answer[1]).removeprefix(f"{path} "), str(answer[2]), seconds)
        return ToolOutcome(str(answer[1]), None, seconds)


__all__ = [
    "ToolOutcome",
    "ToolPool",
    "VerifierPool",
    "every_child_imports",
    "text_reader",
    "tool_modules",
    "tool_warmup",
]

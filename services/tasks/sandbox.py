"""Run verifiers in worker processes that can be killed: one bad sample never stalls a worker.

A verifier is named by import path, "pkg.module:function", and called as
`function(*args)` in a child process. The parent waits on the child's pipe
with an asyncio deadline. On timeout the child is killed (SIGKILL: a
verifier stuck in C code ignores everything else) and replaced; a raising
verifier is reported by the child; a child that dies mid-call is replaced.
Each of these gives reward 0 and a counted, named error, and the caller
carries on — a thread-based `wait_for` could not stop a hung pure-Python or
C loop, which is why this is a process.

Children are plain subprocesses (`python -m services.tasks.sandbox`)
speaking length-prefixed MessagePack on stdin/stdout — no pickle, and no
fork of a parent that runs an event loop, NATS and torch threads. Request
`[path, args]`; answer `["ok", reward, parts]` or `["error", message]`.
Request `[path, args, "value"]` (a tool call) answers `["value", text]`.
Request `[path, [args, ...], "many"]` (a group's completions) answers
`["many", [answer, ...]]`, one `["ok", ...]` or `["error", ...]` per call: one
pipe round trip (two syscalls and a wake-up of each process) per group
instead of per completion, which at k = 1 was the rollout worker's largest
cost outside the engine's HTTP (bench/results_cpu.md).

Tool children (`ToolPool`) also start confined: an address-space limit
(RLIMIT_AS) and an audit hook that refuses sockets, subprocesses and
exec. The hook cannot be removed from Python code; it is a guard against
a policy's code reaching out, not a jail against a determined attacker
(ctypes could step around it): run untrusted tools in a container too.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Self

import msgpack

from services.runtime.errors import ConfigError

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class Reward:
    """A verifier's verdict: reward, optional named parts, and the error if it failed."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def resolve(path: str) -> Callable[..., Any]:
    """Import "pkg.module:function"; ConfigError naming the path if it cannot."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"verifier {path!r} must look like 'pkg.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import verifier {path!r}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"verifier {path!r} is not callable")
    return fn


def to_reward(value: Any) -> Reward:
    """Accept a number, (number, parts) or {"reward": number, "parts": {...}}."""
    parts: dict[str, float] = {}
    if isinstance(value, dict):
        parts = {str(k): float(v) for k, v in (value.get("parts") or {}).items()}
        value = value["reward"]
    elif isinstance(value, tuple) and len(value) == 2:
        value, raw_parts = value
        parts = {str(k): float(v) for k, v in raw_parts.items()}
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward is not finite: {reward}")
    return Reward(reward, parts)


def _read_frame(stream: BinaryIO) -> Any:
    header = stream.read(_LEN.size)
    if len(header) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(header)
    return msgpack.unpackb(stream.read(n), raw=False)


def _frame(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(data)) + data


_DENIED_EVENTS = (
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.getaddrinfo",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.fork",
    "os.forkpty",
)


def confine(memory_mb: int) -> None:
    """A tool child's limits: address space, and no network or new processes."""
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def hook(event: str, _args: tuple[Any, ...]) -> None:
        if event in _DENIED_EVENTS:
            raise PermissionError(f"{event} is not allowed in the tool sandbox")

    sys.addaudithook(hook)


def _verdict(fn: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    """["ok", reward, parts] of one call, or ["error", message] if it raised."""
    try:
        r = to_reward(fn(*args))
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
        return ["error", f"{type(e).__name__}: {e}"]
    return ["ok", r.reward, r.parts]


def preload(modules: list[str]) -> float:
    """A child's first call: import `modules` (VerifierPool.PRELOAD)."""
    for module in modules:
        importlib.import_module(module)
    return 1.0


_PRELOAD = "services.tasks.sandbox:preload"


def _child_main(argv: Sequence[str]) -> None:
    """Child loop: read [path, args(, "value" | "many")], answer ["ok", reward, parts],
    ["value", text], ["many", [verdict, ...]] or ["error", message]."""
    if argv[:1] == ["--confine"]:
        confine(int(argv[1]))
    cache: dict[str, Callable[..., Any]] = {}
    out = sys.stdout.buffer
    while True:
        try:
            path, args, *mode = _read_frame(sys.stdin.buffer)
        except EOFError:
            return
        try:
            fn = cache.get(path) or cache.setdefault(path, resolve(path))
            if mode == ["value"]:
                out.write(_frame(["value", str(fn(*args))]))
            elif mode == ["many"]:
                out.write(_frame(["many", [_verdict(fn, a) for a in args]]))
            else:
                out.write(_frame(_verdict(fn, args)))
        except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
            out.write(_frame(["error", f"{type(e).__name__}: {e}"]))
        out.flush()


class _Child:
    """One verifier subprocess and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, argv: Sequence[str] = ()) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.tasks.sandbox",
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def roundtrip(self, path: str, args: tuple[Any, ...], mode: str | None = None) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(_frame([path, list(args), *([mode] if mode else [])]))
        await self.proc.stdin.drain()
        try:
            header = await self.proc.stdout.readexactly(_LEN.size)
            body = await self.proc.stdout.readexactly(_LEN.unpack(header)[0])
        except asyncio.IncompleteReadError as e:
            raise EOFError("verifier process closed its pipe") from e
        return msgpack.unpackb(body, raw=False)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


class VerifierPool:
    """`size` verifier processes; `await pool.call(path, *args)` never hangs past the limit.

    `errors` counts failures by kind ("timeout", "raised", "crashed");
    `calls` counts every call. Use `async with VerifierPool(...) as pool`.

    `warmup`: calls every new child makes before it serves (import math-verify,
    build a reasoning-gym dataset: seconds, which must not count against the
    first real call's limit, or a slow import times out on every child it
    replaces). A warm-up that fails at start is a ConfigError. Before those,
    every child imports `PRELOAD`, the reward entry point (pydantic and the
    reward classes: a tenth of a second of CPU, seconds on a loaded box).
    """

    WARMUP_TIMEOUT_S = 120.0
    PRELOAD: tuple[str, ...] = ("services.tasks.rewards",)

    def __init__(
        self,
        size: int = 2,
        timeout_s: float = 5.0,
        warmup: Sequence[tuple[str, tuple[Any, ...]]] = (),
    ) -> None:
        if size < 1 or timeout_s <= 0:
            raise ConfigError("verifier pool needs size >= 1 and timeout_s > 0")
        self.size = size
        self.timeout_s = timeout_s
        self.warmup = tuple(warmup)
        self.errors: Counter[str] = Counter()
        self.calls = 0
        self._idle: asyncio.Queue[_Child] | None = None
        self._all: list[_Child] = []

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        children = await asyncio.gather(*(self._spawn(strict=True) for _ in range(self.size)))
        for child in children:
            self._idle.put_nowait(child)

    argv: tuple[str, ...] = ()  # the children's command-line options

    async def _spawn(self, strict: bool = False) -> _Child:
        child = await _Child.start(self.argv)
        self._all.append(child)
        preload = [(_PRELOAD, (list(self.PRELOAD),))] if self.PRELOAD else []
        for path, args in [*preload, *self.warmup]:
            try:
                answer = await asyncio.wait_for(child.roundtrip(path, args), self.WARMUP_TIMEOUT_S)
            except (TimeoutError, EOFError, OSError) as e:
                answer = ["error", f"{type(e).__name__}: {e}"]
            if answer[0] == "error":
                if strict:
                    await self.close()
                    raise ConfigError(f"verifier warm-up {path} failed: {answer[1]}")
                log.warning("verifier warm-up %s failed: %s", path, answer[1])
        return child

    async def _retire(self, child: _Child) -> _Child:
        await child.kill()
        self._all.remove(child)
        return await self._spawn()

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
        child = await self._idle.get()
        try:
            answer: list[Any] = await asyncio.wait_for(child.roundtrip(path, args, mode), limit)
        except TimeoutError:
            if count:
                log.warning("sandbox: %s timed out after %.1fs; killing its process", path, limit)
            self.errors["timeout"] += count
            child = await self._retire(child)
            return ["error", f"{path} timed out after {limit}s", "timeout"]
        except (EOFError, OSError, ConnectionError) as e:
            self.errors["crashed"] += count
            child = await self._retire(child)
            return ["error", f"{path} process died: {e!r}", "crashed"]
        finally:
            self._idle.put_nowait(child)
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


class ToolPool(VerifierPool):
    """Confined children (memory limit, no network or subprocesses) that run tool calls.

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
    ) -> None:
        # warm-up: import the tools module (and the user's tools) before the first call
        warm = ("services.tasks.tools:warm", (list(tools),))
        super().__init__(size, timeout_s, warmup=[warm])
        self.argv = ("--confine", str(memory_mb))

    async def run(self, path: str, *args: Any, timeout_s: float | None = None) -> ToolOutcome:
        """`path(*args)` as text; a hang, raise or crash is an outcome with its error."""
        started = time.monotonic()
        answer = await self._exchange(path, args, timeout_s or self.timeout_s, "value")
        seconds = time.monotonic() - started
        if answer[0] == "error":
            return ToolOutcome(str(answer[1]).removeprefix(f"{path} "), str(answer[2]), seconds)
        return ToolOutcome(str(answer[1]), None, seconds)


if __name__ == "__main__":
    _child_main(sys.argv[1:])

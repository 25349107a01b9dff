"""Run verifiers in worker processes that can be killed: one bad sample never stalls a worker.

A verifier is named by import path, "pkg.module:function", and called as
`function(*args)` in a child process. The parent waits on the child's pipe
with an asyncio deadline. On timeout the child is killed (SIGKILL: a
verifier stuck in C code ignores everything else) and replaced; a raising
verifier is reported by the child; a child that dies mid-call is replaced.
Each of these gives reward 0 and a counted, named error, and the caller
carries on — a thread-based `wait_for` could not stop a hung pure-Python or
C loop, which is why this is a process.

Children are plain subprocesses (`python -m services.common.tasks.sandbox`)
speaking length-prefixed MessagePack on stdin/stdout — no pickle, and no
fork of a parent that runs an event loop, NATS and torch threads. Request
`[path, args]`; answer `["ok", reward, parts]` or `["error", message]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import struct
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack

from services.common.errors import ConfigError

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


def _child_main() -> None:
    """Child loop: read [path, args], answer ["ok", reward, parts] or ["error", message]."""
    cache: dict[str, Callable[..., Any]] = {}
    out = sys.stdout.buffer
    while True:
        try:
            path, args = _read_frame(sys.stdin.buffer)
        except EOFError:
            return
        try:
            fn = cache.get(path) or cache.setdefault(path, resolve(path))
            r = to_reward(fn(*args))
            out.write(_frame(["ok", r.reward, r.parts]))
        except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
            out.write(_frame(["error", f"{type(e).__name__}: {e}"]))
        out.flush()


class _Child:
    """One verifier subprocess and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.common.tasks.sandbox",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def roundtrip(self, path: str, args: tuple[Any, ...]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(_frame([path, list(args)]))
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
    replaces). A warm-up that fails at start is a ConfigError.
    """

    WARMUP_TIMEOUT_S = 120.0

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

    async def __aenter__(self) -> VerifierPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        children = await asyncio.gather(*(self._spawn(strict=True) for _ in range(self.size)))
        for child in children:
            self._idle.put_nowait(child)

    async def _spawn(self, strict: bool = False) -> _Child:
        child = await _Child.start()
        self._all.append(child)
        for path, args in self.warmup:
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

    async def call(self, path: str, *args: Any, timeout_s: float | None = None) -> Reward:
        """Run `path(*args)` in a child; Reward(0, error=...) on timeout, raise or crash."""
        if self._idle is None:
            raise RuntimeError("VerifierPool used before start()")
        self.calls += 1
        limit = timeout_s or self.timeout_s
        child = await self._idle.get()
        try:
            answer = await asyncio.wait_for(child.roundtrip(path, args), limit)
        except TimeoutError:
            log.warning("verifier %s timed out after %.1fs; killing its process", path, limit)
            self.errors["timeout"] += 1
            child = await self._retire(child)
            return Reward(0.0, error=f"verifier {path} timed out after {limit}s")
        except (EOFError, OSError, ConnectionError) as e:
            self.errors["crashed"] += 1
            child = await self._retire(child)
            return Reward(0.0, error=f"verifier {path} process died: {e!r}")
        finally:
            self._idle.put_nowait(child)
        if answer[0] == "error":
            self.errors["raised"] += 1
            return Reward(0.0, error=f"verifier {path} raised {answer[1]}")
        return Reward(float(answer[1]), {str(k): float(v) for k, v in answer[2].items()})


if __name__ == "__main__":
    _child_main()

"""Run verifiers in worker processes that can be killed: one bad sample never stalls a worker.

A verifier is named by import path, "pkg.module:function", and called as
`function(*args)` in a child process. The parent waits on the child's pipe
with an asyncio deadline (`loop.add_reader`, no threads). On timeout the
child is killed (SIGKILL: a verifier stuck in C code ignores everything
else) and replaced; a raising verifier is reported by the child; a child
that dies mid-call is replaced. Each of these gives reward 0 and a counted,
named error, and the caller carries on — a thread-based `wait_for` could
not stop a hung pure-Python or C loop, which is why this is a process.

Children start with the "spawn" method: forking a parent that runs an
event loop, NATS and torch threads is unsafe, and a spawned child imports
only this module and the verifier's.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import multiprocessing
import multiprocessing.connection
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import ConfigError

log = logging.getLogger(__name__)


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


def _child_main(conn: multiprocessing.connection.Connection) -> None:
    """Child loop: receive (path, args), answer ("ok", Reward) or ("error", message)."""
    cache: dict[str, Callable[..., Any]] = {}
    while True:
        try:
            path, args = conn.recv()
        except EOFError:
            return
        try:
            fn = cache.get(path) or cache.setdefault(path, resolve(path))
            conn.send(("ok", to_reward(fn(*args))))
        except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Child:
    def __init__(self, ctx: Any) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.conn: multiprocessing.connection.Connection = parent
        self.proc = ctx.Process(target=_child_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class VerifierPool:
    """`size` verifier processes; `await pool.call(path, *args)` never hangs past the limit.

    `errors` counts failures by kind ("timeout", "raised", "crashed");
    `calls` counts every call. Use `async with VerifierPool(...) as pool`.
    """

    def __init__(self, size: int = 2, timeout_s: float = 5.0) -> None:
        if size < 1 or timeout_s <= 0:
            raise ConfigError("verifier pool needs size >= 1 and timeout_s > 0")
        self.size = size
        self.timeout_s = timeout_s
        self.errors: Counter[str] = Counter()
        self.calls = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: asyncio.Queue[_Child] | None = None
        self._all: list[_Child] = []

    async def __aenter__(self) -> VerifierPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        for _ in range(self.size):
            self._idle.put_nowait(self._spawn())

    def _spawn(self) -> _Child:
        child = _Child(self._ctx)
        self._all.append(child)
        return child

    def _retire(self, child: _Child) -> _Child:
        child.kill()
        self._all.remove(child)
        return self._spawn()

    async def close(self) -> None:
        for child in list(self._all):
            child.kill()
        self._all.clear()

    async def call(self, path: str, *args: Any, timeout_s: float | None = None) -> Reward:
        """Run `path(*args)` in a child; Reward(0, error=...) on timeout, raise or crash."""
        if self._idle is None:
            raise RuntimeError("VerifierPool used before start()")
        self.calls += 1
        limit = timeout_s or self.timeout_s
        child = await self._idle.get()
        try:
            status, payload = await asyncio.wait_for(self._roundtrip(child, path, args), limit)
        except TimeoutError:
            log.warning("verifier %s timed out after %.1fs; killing its process", path, limit)
            self.errors["timeout"] += 1
            child = self._retire(child)
            return Reward(0.0, error=f"verifier {path} timed out after {limit}s")
        except (EOFError, OSError) as e:
            self.errors["crashed"] += 1
            child = self._retire(child)
            return Reward(0.0, error=f"verifier {path} process died: {e!r}")
        finally:
            self._idle.put_nowait(child)
        if status == "error":
            self.errors["raised"] += 1
            return Reward(0.0, error=f"verifier {path} raised {payload}")
        assert isinstance(payload, Reward)
        return payload

    async def _roundtrip(self, child: _Child, path: str, args: tuple[Any, ...]) -> Any:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = child.conn.fileno()

        def on_readable() -> None:
            if not ready.done():
                ready.set_result(None)

        child.conn.send((path, args))
        loop.add_reader(fd, on_readable)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return child.conn.recv()

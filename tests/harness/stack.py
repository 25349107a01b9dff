"""A run's processes as `flywheel up` starts them, with the handles a test needs.

The processes are the product's plan (services/stack/plan.py: the same
argv, run file and per-process environment `flywheel up` gives them) and
they are started, restarted and stopped by the product's own Supervisor
(services/stack/supervisor.py: logs under `<run_dir>/logs`, readiness by
each process's ready URL, `pids.json`). What this adds is control from a
plain test: the supervisor's event loop runs in a background thread, and
`Stack` calls into it, so a test can start part of the plan now and the
rest later (an engine joining mid-run: plan three, start two), kill -9 one
process and restart it by hand, run a variant of a planned process (sync in
another update mode), or let the supervisor restart what dies
(`supervise()`, as `flywheel up` does with `on_failure = "restart"`).

The harness adds to each planned process only what a test on a shared
machine needs: one torch thread, no tokenizer thread pool, and a rollout
worker's engine-local weights directory under the run directory (not the
default under the current directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from tests.harness.ports import free_port
from tests.harness.probe import UNREACHABLE, http_json, metric, metric_sum

T = TypeVar("T")

QUIET_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Proc:
    """One planned process of a `Stack`: its URLs, log, metrics, and kill/restart/stop."""

    def __init__(self, stack: Stack, name: str) -> None:
        self.stack = stack
        self.name = name

    @property
    def _p(self) -> Any:  # the supervisor's record of it (services.stack.supervisor.Proc)
        return self.stack.sup.get(self.name)

    @property
    def spec(self) -> Any:
        return self._p.spec

    @property
    def alive(self) -> bool:
        return bool(self._p.alive)

    @property
    def pid(self) -> int:
        assert self._p.proc is not None, f"{self.name} was never started"
        return int(self._p.proc.pid)

    @property
    def url(self) -> str:
        """Base URL: an engine's API, a service's metrics-and-health server."""
        ready = self.spec.ready_url or ""
        return ready.rsplit("/", 1)[0]

    @property
    def metrics_url(self) -> str:
        return self.spec.metrics_url or f"{self.url}/metrics"

    def log(self) -> str:
        path: Path = self._p.log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def metric(self, name: str, labels: str | None = None) -> float | None:
        return metric(self.metrics_url, name, labels)

    def metric_sum(self, name: str) -> float | None:
        return metric_sum(self.metrics_url, name)

    def start(self) -> None:
        self.stack.start(self.name)

    def kill9(self) -> None:
        """SIGKILL, and wait until it is gone (its log is complete)."""
        self.stack.call(self._kill(signal.SIGKILL))

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), SIGKILL after the stack's grace period."""
        self.stack.call(self._stop())

    def restart(self) -> None:
        """Start it again (the supervisor's spawn: same argv and environment), until ready."""
        self.stack.call(self._restart())

    async def _kill(self, sig: int) -> None:
        p = self._p
        assert p.proc is not None, f"{self.name} was never started"
        with contextlib.suppress(ProcessLookupError):
            p.proc.send_signal(sig)
        await p.proc.wait()
        if p.pump is not None:
            await p.pump

    async def _stop(self) -> None:
        p = self._p
        if not p.alive:
            return
        p.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(p.proc.wait(), self.stack.sup.stop_grace_s)
        except TimeoutError:
            await self._kill(signal.SIGKILL)
        if p.pump is not None:
            await p.pump

    async def _restart(self) -> None:
        p = self._p
        p.restarts += 1
        await self.stack.sup.spawn(p)
        await self.stack.sup.wait_ready(p)


class Stack:
    """The plan of the run file at `config` against `nats_url`, supervised in a thread.

    Use as a context manager (stops everything on exit). Nothing starts until
    `start(...)`, `start_all()` or `Proc.start()`.
    """

    def __init__(self, config: Path, nats_url: str, *, env: dict[str, str] | None = None) -> None:
        from services.runtime.settings import load_settings
        from services.stack.plan import plan
        from services.stack.settings import StackSettings
        from services.stack.supervisor import Supervisor

        self.config = config.resolve()
        self.nats_url = nats_url
        self.settings = load_settings(StackSettings, self.config)
        self.run = self.settings.run
        self.root = self.settings.run_dir.resolve()
        specs = plan(self.settings, self.config, nats_url, free_port)
        self.sup = Supervisor(
            [self._harness_env(s, env or {}) for s in specs], self.root / "logs",
            on_failure=self.settings.on_failure, max_restarts=self.settings.max_restarts,
            ready_timeout_s=self.settings.ready_timeout_s, stop_grace_s=self.settings.stop_grace_s,
            console=None, pids_file=self.root / "pids.json",
        )  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stack", daemon=True)
        self._thread.start()
        self._stop_watch: asyncio.Event | None = None
        self._watch: Any = None

    def _harness_env(self, spec: Any, env: dict[str, str]) -> Any:
        extra = dict(QUIET_ENV)
        if spec.kind == "rollout":
            i = spec.name.rsplit("-", 1)[1]
            extra["FLYWHEEL_ROLLOUT_WEIGHTS_DIR"] = str(self.root / f"engine-weights-{i}")
        return replace(spec, env={**spec.env, **extra, **env})

    # ── the supervisor's loop, from plain code ──────────────────────────────
    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the supervisor's event loop; its result (or exception) here."""
        limit = timeout_s or self.settings.ready_timeout_s + 60
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(limit)

    # ── starting ─────────────────────────────────────────────────────────────
    @property
    def names(self) -> list[str]:
        return [p.name for p in self.sup.procs]

    def proc(self, name: str) -> Proc:
        self.sup.get(name)  # StopIteration for a name the plan lacks
        return Proc(self, name)

    __getitem__ = proc

    def start(self, *names: str) -> None:
        """Start these processes together, then wait until each is ready (or fail with
        the supervisor's report: who died, its exit code, its last lines)."""

        async def go() -> None:
            procs = [self.sup.get(n) for n in names]
            for p in procs:
                await self.sup.spawn(p)
            await asyncio.gather(*(self.sup.wait_ready(p) for p in procs))

        self.call(go())

    def start_kinds(self, *kinds: str, but: tuple[str, ...] = ()) -> None:
        """Start every planned process of these kinds (except `but`) together."""
        self.start(*(p.name for p in self.sup.procs if p.spec.kind in kinds and p.name not in but))

    def start_all(self) -> None:
        """Everything, as `flywheel up` does (kind by kind, each once the previous is ready)."""
        self.call(self.sup.start_all())

    def variant(self, of: str, name: str, env: dict[str, str]) -> Proc:
        """A new process like planned `of` with more environment (not started)."""
        from services.stack.supervisor import Proc as SupProc

        base = self.sup.get(of).spec
        spec = replace(base, name=name, env={**base.env, **env})
        if spec.metrics_url:  # its own metrics port: two may run at once
            port = free_port()
            prefix = f"FLYWHEEL_{spec.kind.upper()}_"
            spec = replace(spec, env={**spec.env, f"{prefix}METRICS_PORT": str(port)},
                           ready_url=f"http://127.0.0.1:{port}/readyz",
                           metrics_url=f"http://127.0.0.1:{port}/metrics")  # fmt: skip
        self.sup.procs.append(SupProc(spec, self.root / "logs" / f"{name}.log"))
        return Proc(self, name)

    def supervise(self) -> None:
        """Let the supervisor watch: restart (or stop on) what dies, per [stack] on_failure."""

        async def go() -> None:
            self._stop_watch = asyncio.Event()
            self._watch = asyncio.ensure_future(self.sup.watch(self._stop_watch))

        self.call(go())

    @property
    def failed(self) -> str | None:
        """Why the supervisor stopped the run (a service died for good), if it did."""
        return self.sup.failed

    # ── stopping ─────────────────────────────────────────────────────────────
    def close(self) -> None:
        async def go() -> None:
            if self._stop_watch is not None:
                self._stop_watch.set()
                await self._watch
            await self.sup.stop_all()

        try:
            self.call(go(), timeout_s=self.settings.stop_grace_s * 2 + 30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ── reading the run ──────────────────────────────────────────────────────
    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    def trained_rows(self) -> list[dict[str, Any]]:
        """The trainer's metrics rows of trained steps (not evaluation-only rows)."""
        if not self.metrics_file.exists():
            return []
        rows = [json.loads(ln) for ln in self.metrics_file.read_text().splitlines() if ln]
        return [r for r in rows if "batch_id" in r]

    def trained_steps(self) -> int:
        return max((int(r["step"]) for r in self.trained_rows()), default=0)

    def engine_info(self, i: int) -> dict[str, Any] | None:
        try:
            return dict(http_json(f"{self.proc(f'engine-{i}').url}/model_info", timeout_s=2.0))
        except UNREACHABLE:
            return None

    def engine_version(self, i: int) -> int | None:
        """The weight version engine `i` serves (None: unreachable)."""
        info = self.engine_info(i)
        if info is None:
            return None
        v = str(info.get("weight_version", ""))
        return int(v) if v.isdigit() else 0

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(f"==== {n}\n{self.proc(n).log()[-tail:]}" for n in self.names)


@contextlib.contextmanager
def printing_logs_on_failure(stack: Stack) -> Iterator[Stack]:
    """Yield the stack; on any exception print every process's log tail first."""
    try:
        yield stack
    except BaseException:
        print(stack.logs())
        raise


def start_loop(st: Stack) -> None:
    """The whole loop in readiness order (two engines and their workers), logs on failure.
    A worker starts beside its engine (it waits for it): their start-ups overlap."""
    with printing_logs_on_failure(st):
        st.start("engine-0", "engine-1", "rollout-0", "rollout-1")
        st.start("sync", "trainer")
        st.start("buffer")


def stack_table(root: Path, model: Path, engines: int = 2, **more: Any) -> dict[str, Any]:
    """The `[stack]` table of a test's run file: the run under `root`, an external
    nats-server (the test's), `engines` CPU engines with one torch thread each."""
    return {"run_dir": str(root), "model": str(model), "embedded_nats": False,
            "engines": engines, "engine_threads": 1, "on_failure": "stop",
            "stop_grace_s": 10.0, "ready_timeout_s": 120.0, **more}  # fmt: skip

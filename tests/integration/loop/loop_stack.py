"""A whole training loop as real subprocesses, for the loop tests.

Engines (the CPU engine server), rollout workers, sync, trainer and buffer,
each `python -m services.<x>` with one small run file plus per-process
environment overrides (ports, ids, URLs) — what `flywheel up` does, but
with handles a test needs: start one more engine mid-run, kill -9 one
process, restart it, read a service's metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def http_ok(url: str) -> bool:
    """200 within 30 s (an engine's /health_generate, like SGLang's, takes >= 1 s)."""
    try:
        with urllib.request.urlopen(url, timeout=30.0) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_for(check: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    """Poll `check` until truthy (returning its value); fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


def run_file(run: str, **sections: dict[str, Any]) -> str:
    """TOML text of a run file: `run = …` then one table per keyword (nested dicts as tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)

    lines = [f'run = "{run}"']

    def table(name: str, body: dict[str, Any]) -> None:
        lines.append(f"\n[{name}]")
        nested = {k: v for k, v in body.items() if isinstance(v, dict)}
        lines.extend(f"{k} = {value(v)}" for k, v in body.items() if not isinstance(v, dict))
        for k, v in nested.items():
            table(f"{name}.{k}", v)

    for name, body in sections.items():
        table(name, body)
    return "\n".join(lines) + "\n"


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready_url: str | None
    metrics_url: str | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        f = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", **self.env}  # fmt: skip
        self.popen = subprocess.Popen(
            self.argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        f.close()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        if self.ready_url is None:
            return

        def ready() -> bool:
            if not self.alive:
                raise AssertionError(f"{self.name} exited:\n{self.log()[-3000:]}")
            return http_ok(self.ready_url or "")

        wait_for(ready, timeout_s, f"{self.name} ready", poll_s=0.2)

    def kill9(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        if not self.alive or self.popen is None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def metric(self, name: str, labels: str | None = None) -> float | None:
        """One sample of a Prometheus metric from this process (None: absent/unreachable)."""
        try:
            with urllib.request.urlopen(self.metrics_url or "", timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        want = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{\})?")
        m = re.search(rf"^{want} (?P<value>\S+)$", text, re.M)
        return float(m.group("value")) if m else None


def py(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


@dataclass
class LoopStack:
    root: Path
    run: str
    nats_url: str
    model: Path
    config: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    def _service(self, kind: str, name: str, env: dict[str, str]) -> Proc:
        port = free_port()
        prefix = f"FLYWHEEL_{kind.upper()}_"
        env = {f"{prefix}NATS__URL": self.nats_url, f"{prefix}METRICS_PORT": str(port),
               f"{prefix}RUN": self.run, **env}  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        module = "services.trainer" if kind == "trainer" else f"services.{kind}"
        p = Proc(name, py(module, "-c", str(self.config)), env, self.root / f"{name}.log",
                 f"{base}/readyz", f"{base}/metrics")  # fmt: skip
        self.procs[name] = p
        return p

    def engine(self, i: int) -> Proc:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = py("services.engine", "--config", str(self.config), "--model",
                  str(self.model), "--port", str(port), "--weight-version", "0")  # fmt: skip
        p = Proc(f"engine-{i}", argv, {}, self.root / f"engine-{i}.log", f"{url}/health_generate")
        p.metrics_url = url  # the engine's base URL (model_info lives there)
        self.procs[p.name] = p
        return p

    def rollout(self, i: int) -> Proc:
        engine = self.procs[f"engine-{i}"]
        return self._service("rollout", f"rollout-{i}", {
            "FLYWHEEL_ROLLOUT_ENGINE_URL": engine.metrics_url or "",
            "FLYWHEEL_ROLLOUT_ENGINE_ID": f"engine-{i}",
            "FLYWHEEL_ROLLOUT_WORKER_ID": f"rollout-{i}",
            "FLYWHEEL_ROLLOUT_MODEL": str(self.model),
            "FLYWHEEL_ROLLOUT_WEIGHTS_DIR": str(self.root / f"engine-weights-{i}"),
        })  # fmt: skip

    def sync(self) -> Proc:
        return self._service("sync", "sync", {"FLYWHEEL_SYNC_WEIGHTS_ROOT": str(self.weights)})

    def trainer(self) -> Proc:
        return self._service("trainer", "trainer", {
            "FLYWHEEL_TRAINER_MODEL": str(self.model),
            "FLYWHEEL_TRAINER_WEIGHTS_ROOT": str(self.weights),
            "FLYWHEEL_TRAINER_CHECKPOINT_DIR": str(self.root / "checkpoints"),
            "FLYWHEEL_TRAINER_METRICS_FILE": str(self.metrics_file),
        })  # fmt: skip

    def buffer(self) -> Proc:
        return self._service("buffer", "buffer", {})

    def start(self, *procs: Proc) -> None:
        """Start together, then wait for each to be ready (they import torch in parallel)."""
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()

    def engine_version(self, i: int) -> int | None:
        try:
            info = http_json(f"{self.procs[f'engine-{i}'].metrics_url}/model_info")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        v = str(info.get("weight_version", ""))
        return int(v) if v.isdigit() else 0

    def model_path(self, i: int) -> str:
        return str(http_json(f"{self.procs[f'engine-{i}'].metrics_url}/model_info")["model_path"])

    def trained_rows(self) -> list[dict[str, Any]]:
        if not self.metrics_file.exists():
            return []
        rows = [json.loads(line) for line in self.metrics_file.read_text().splitlines() if line]
        return [r for r in rows if "batch_id" in r]

    def trained_steps(self) -> int:
        rows = self.trained_rows()
        return max((int(r["step"]) for r in rows), default=0)

    def logs(self) -> str:
        return "\n".join(f"==== {n}\n{p.log()[-2500:]}" for n, p in self.procs.items())

    def stop_all(self) -> None:
        for p in reversed(list(self.procs.values())):
            if p.alive and p.popen is not None:
                p.popen.terminate()
        for p in reversed(list(self.procs.values())):
            p.stop()


# ── reading the run's streams (a plain NATS client, as an operator would) ─────
def read_stream(nats_url: str, stream: str, subject: str) -> list[bytes]:
    """Every message body on `subject` in `stream`, in order (chunked messages joined)."""
    import asyncio

    import nats
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from proto.chunking import Reassembler

    async def body() -> list[bytes]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream, subjects_filter=subject)
            want = sum((info.state.subjects or {}).values())
            cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                                 inactive_threshold=10.0)  # fmt: skip
            sub = await js.pull_subscribe(subject, durable=None, stream=stream, config=cfg)
            r = Reassembler()
            out: list[bytes] = []
            seen = 0
            while seen < want:
                try:
                    msgs = await sub.fetch(min(256, want - seen), timeout=5)
                except NatsTimeout:
                    break
                for m in msgs:
                    seen += 1
                    whole = r.feed(m.data)
                    if whole is not None:
                        out.append(whole)
            await sub.unsubscribe()
            return out
        finally:
            await nc.close()

    return asyncio.run(body())


def messages(nats_url: str, run: str, what: str, subject: str, cls: type) -> list[Any]:
    from proto.codec import decode
    from proto.streams import stream_name

    return [decode(b, cls) for b in read_stream(nats_url, stream_name(run, what), subject)]

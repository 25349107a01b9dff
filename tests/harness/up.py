"""`flywheel up` itself, as a user runs it: a subprocess with a run file, read from outside.

For the suites whose subject is the command (e2e, chaos, the live
Prometheus scrape): the run is `python -m services up -c run.toml`, its
console goes to a log file, and everything else is read the way an
operator would: the supervisor's `<run_dir>/pids.json` and `procs.json`
(pid, restarts, metrics URL of each process), each service's log under
`<run_dir>/logs/`, its /metrics, the trainer's metrics file. Stopping is
Ctrl-C (SIGINT to the process group), as a user stops it; SIGKILL only if
it does not stop within the grace period.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness import REPO
from tests.harness.poll import wait_for
from tests.harness.probe import metric_sum

QUIET_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def flywheel(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
             cwd: Path = REPO) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`flywheel ARGS` (as `python -m services`), run to completion; its output captured."""
    return subprocess.run([sys.executable, "-m", "services", *args], cwd=cwd,
                          env=env or {**os.environ, **QUIET_ENV}, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def start(args: list[str], log: Path, env: dict[str, str] | None = None,
          cwd: Path = REPO) -> subprocess.Popen[bytes]:  # fmt: skip
    """`flywheel ARGS` in the background, in its own process group, output to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "services", *args], cwd=cwd,
                                env=env or {**os.environ, **QUIET_ENV}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, grace_s: float = 60) -> int:
    """Signal the process (Ctrl-C by default) and wait; SIGKILL its group after `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)


class UpRun:
    """One `flywheel up -c config [args]` run; `run_dir` is its `[stack] run_dir`."""

    def __init__(self, config: Path, run_dir: Path, *args: str, log: Path | None = None,
                 env: dict[str, str] | None = None, cwd: Path = REPO,
                 check: bool = False) -> None:  # fmt: skip
        """`check`: run `up`'s pre-flight check (tests/integration/stack/test_check.py tests
        it; elsewhere it would only add its sampling to every run's start)."""
        self.config, self.run_dir = config, run_dir
        self.args = args if check else ("--no-check", *args)
        self.log = log or config.parent / "up.log"
        self.env, self.cwd = env, cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> UpRun:
        self.proc = start(["up", "-c", str(self.config), *self.args], self.log, self.env, self.cwd)
        return self

    def __enter__(self) -> UpRun:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ── its console ──────────────────────────────────────────────────────────
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def running(self) -> bool:
        """True while it runs; AssertionError with its output once it has exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"flywheel up exited ({self.proc.returncode}):\n"
                                 f"{self.output()[-4000:]}")  # fmt: skip
        return True

    def wait_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Until a console line matches `pattern` (failing early if `up` exits first)."""

        def seen() -> re.Match[str] | None:
            m = re.search(pattern, self.output())
            if m is None:
                self.running()  # exited without it: fail now, with its output
            return m

        return wait_for(seen, timeout_s, f"{pattern!r} from flywheel up", 0.2)

    def wait_ready(self, timeout_s: float = 180) -> None:
        self.wait_line("all services ready", timeout_s)

    def wait_exit(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, sig: int = signal.SIGINT, grace_s: float = 60) -> int | None:
        """Ctrl-C (it stops its services in order); None if it was never started."""
        return stop(self.proc, sig, grace_s) if self.proc is not None else None

    # ── its run directory ────────────────────────────────────────────────────
    def procs(self) -> dict[str, dict[str, Any]]:
        """`procs.json`: per process its pid, restarts, metrics and ready URLs."""
        try:
            return dict(json.loads((self.run_dir / "procs.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def pids(self) -> dict[str, int]:
        try:
            doc = json.loads((self.run_dir / "pids.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return {k: int(v) for k, v in doc.items()}

    def restarts(self) -> dict[str, int]:
        """Restarts per process, as the supervisor counts them."""
        return {n: int(d["restarts"]) for n, d in self.procs().items()}

    def metrics_url(self, name: str) -> str | None:
        url = self.procs().get(name, {}).get("metrics_url")
        return str(url) if url else None

    def metric(self, name: str, metric: str) -> float | None:
        """The sum of `metric` over its label sets at process `name` (None: unreachable)."""
        url = self.metrics_url(name)
        return metric_sum(url, metric) if url else None

    def service_log(self, name: str) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def rows(self) -> list[dict[str, Any]]:
        """The trainer's metrics rows of trained steps."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        return [r for r in rows if "batch_id" in r]

    def step(self) -> int:
        return max((int(r["step"]) for r in self.rows()), default=0)

    def diagnostics(self) -> str:
        parts = [f"==== up.log\n{self.output()[-3000:]}"]
        parts += [f"==== {n}\n{self.service_log(n)[-2500:]}" for n in sorted(self.pids())]
        return "\n".join(parts)

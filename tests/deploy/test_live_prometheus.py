"""A real Prometheus scrapes a running local stack; every dashboard query returns data.

The stack is `flywheel up` (a subprocess: embedded nats-server, one CPU
engine, one rollout worker, sync, trainer, buffer) on a tiny random model
with small steps. Its services bind free ports; each one logs
"<service>: metrics and health on http://host:port" to
<run_dir>/logs/<name>.log, which is where the scrape targets come from.
Prometheus (Debian's binary) runs on loopback with a 1 s scrape interval
and the repository's rules file (evaluated every second here instead of
every 30 s), so recording-rule panels are exercised too.

Why a custom filter: a random model almost never answers correctly, so
every group has zero reward variance; the zero-variance filter is turned
off so that batches form and the trainer steps, and a filter that drops
every third group makes the buffer dead-letter some groups (reason
`custom_filter`), which the dead-letter panels need to show.
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
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.deploy.deploy_support import DASHBOARDS, ROOT, RULES, run, tool

pytestmark = pytest.mark.slow

SERVICES = ("buffer", "rollout-0", "sync", "trainer")
METRICS_LINE = re.compile(r"(\w+): metrics and health on (http://[\d.]+:\d+)")
RATE_INTERVAL = "30s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval

FILTER = '''
def every_third(group):
    """Drop every third group (by a stable hash of its id): a dead-letter source."""
    import zlib

    return "every_third" if zlib.crc32(group.group_id.encode()) % 3 == 0 else None
'''

RUN_FILE = """
run = "live"

[stack]
run_dir = "{run_dir}"
model = "{model}"
engines = 1
engine_threads = 1
on_failure = "stop"
ready_timeout_s = 90
status_interval_s = 1

[task]
source = {{ type = "arithmetic", digits = 1 }}

[task.eval]
source = {{ type = "arithmetic", digits = 1, seed = 1000003 }}
size = 4
max_new_tokens = 4

[buffer]
samples_per_prompt = 4
groups_per_step = 2
max_new_tokens = 4
max_staleness = 1
oversample = 0.5
filter_zero_variance = false
custom_filter = "live_filter:every_third"
dispatch_interval_s = 0.1

[rollout]
concurrency = 4
heartbeat_s = 0.5

[engine]
max_running_requests = 16

[trainer]
publish_every = 1
eval_every = 1

[trainer.runtime]
cpu_threads = 1

[sync]
tick_s = 0.1
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen | None = None,
             log: Path | None = None):  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log and log.exists() else ""
            pytest.fail(f"{what}: the process exited ({proc.returncode}) first\n{tail}")
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log and log.exists() else ""
            pytest.fail(f"{what}: not within {timeout_s}s\n{tail}")
        time.sleep(0.25)


@dataclass
class Stack:
    run_dir: Path
    targets: dict[str, str]  # process name -> metrics base URL


def metrics_urls(log_dir: Path) -> dict[str, str]:
    found = {}
    for name in SERVICES:
        log = log_dir / f"{name}.log"
        if log.exists() and (m := METRICS_LINE.search(log.read_text(errors="replace"))):
            found[name] = m[2]
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from services.common.tiny_model import TinyModelSpec, write_tiny_model

    tmp = tmp_path_factory.mktemp("live")
    model = write_tiny_model(tmp / "model", TinyModelSpec())
    (tmp / "live_filter.py").write_text(FILTER)
    run_dir = tmp / "run"
    config = tmp / "run.toml"
    config.write_text(RUN_FILE.format(run_dir=run_dir, model=model))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)])}
    env = {k: v for k, v in env.items() if not k.startswith("FLYWHEEL_")}
    console = tmp / "up.log"
    with console.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "-c", str(config), "--quiet"],
            cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for("all services ready", lambda: "all services ready" in console.read_text(),
                 150, proc, console)  # fmt: skip
        targets = wait_for(
            "metrics URLs in the logs",
            lambda: (u := metrics_urls(run_dir / "logs")) and len(u) == len(SERVICES) and u,
            10, proc, console,
        )  # fmt: skip
        yield Stack(run_dir, targets)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # `flywheel up` stops its services in order
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("prometheus")
    rules = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        g["interval"] = "1s"
    (tmp / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yml")],
        "scrape_configs": [
            {
                "job_name": "flywheel",
                "static_configs": [
                    {
                        "targets": [urllib.parse.urlparse(url).netloc],
                        "labels": {"component": name.split("-")[0], "pod": name},
                    }
                    for name, url in sorted(stack.targets.items())
                ],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = run([tool("promtool"), "check", "config", str(tmp / "prometheus.yml")])
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = tmp / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_for("prometheus ready", ready, 30, proc, log)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = http_json(url)
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_every_service_metrics_pass_promtool(stack: Stack) -> None:
    for name, url in stack.targets.items():
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "flywheel_" in text, name
        out = run([tool("promtool"), "check", "metrics"], input=text)
        assert out.returncode == 0, (name, out.stdout + out.stderr)


def test_every_dashboard_query_returns_series(stack: Stack, prometheus: str) -> None:
    # Let the loop turn: a few steps trained, weights made ready, targets up.
    wait_for(
        "every target up",
        lambda: len([r for r in query(prometheus, "up == 1")]) == len(stack.targets),
        30,
    )
    wait_for("two trainer steps and a ready version",
             lambda: query(prometheus, "flywheel_trainer_step >= 2")
             and query(prometheus, "flywheel_sync_ready_version >= 1"), 90)  # fmt: skip
    exprs = []
    for f in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(f.read_text())["panels"]:
            for t in panel.get("targets", []):
                expr = t["expr"].replace("$__rate_interval", RATE_INTERVAL)
                exprs.append((f"{f.stem} / {panel['title']} / {t['refId']}", expr))
    assert len(exprs) > 40
    deadline = time.monotonic() + 30
    missing = dict(exprs)
    while missing and time.monotonic() < deadline:
        missing = {k: e for k, e in missing.items() if not query(prometheus, e)}
        if missing:
            time.sleep(1)
    assert not missing, "queries without data:\n" + "\n".join(
        f"  {k}: {e}" for k, e in missing.items()
    )

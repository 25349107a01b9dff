"""One live `flywheel up` run, seen as a user and an operator see it.

The run is `flywheel up -c run.toml` as a subprocess (embedded nats-server,
one CPU engine with its rollout worker, sync, trainer, buffer) on a tiny
random model with small steps, started once for the module (its engine slowed:
ENGINE_SLEEP_S below). Against it:

- every service's /metrics passes `promtool check metrics`;
- a real Prometheus (Debian's binary, loopback, 1 s scrape interval, the
  repository's rules evaluated every second) scrapes the services, whose
  targets come from where each logs "<service>: metrics and health on
  http://host:port"; every dashboard query returns data;
- `flywheel status -c run.toml` finds the running run from its run file
  alone, and an engine and a worker started by hand with the recipe of
  docs/operations.md (told only the engine's URL and id) join it: sync brings the new
  engine to the run's weights;
- stopped with Ctrl-C, `up` exits 0, and `status` then says no run is up.

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
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.deploy_support import DASHBOARDS, RULES, run, tool
from tests.harness import REPO
from tests.harness.poll import wait_for
from tests.harness.ports import free_port
from tests.harness.probe import post_json
from tests.harness.prometheus import Prometheus
from tests.harness.up import QUIET_ENV, UpRun, flywheel, start, stop

pytestmark = pytest.mark.slow

SERVICES = ("buffer", "rollout-0", "sync", "trainer")
METRICS_LINE = re.compile(r"(\w+): metrics and health on (http://[\d.]+:\d+)")
RATE_INTERVAL = "30s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval
# The run's engine sleeps this long after each decode step (SGLang's /slow_down). Nothing
# here reads how fast the loop turns, only that it does (two steps, a ready version, dead
# letters in a 30 s window), yet at full speed the tiny model's loop trained ~5 steps a
# second for the module's minute, each a version written, announced and loaded: the
# module's largest cost, spent on steps nobody looked at.
ENGINE_SLEEP_S = 0.2

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


@dataclass
class Live:
    up: UpRun
    config: Path
    model: Path
    env: dict[str, str]  # what a user's shell has: no FLYWHEEL_*, the filter importable
    targets: dict[str, str]  # process name -> metrics base URL, from the services' logs


def metrics_urls(log_dir: Path) -> dict[str, str]:
    found = {}
    for name in SERVICES:
        log = log_dir / f"{name}.log"
        if log.exists() and (m := METRICS_LINE.search(log.read_text(errors="replace"))):
            found[name] = m[2]
    return found


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    (tmp / "live_filter.py").write_text(FILTER)
    run_dir = tmp / "run"
    config = tmp / "run.toml"
    config.write_text(RUN_FILE.format(run_dir=run_dir, model=tiny_model))
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": os.pathsep.join([str(tmp), str(REPO)])}
    env = {k: v for k, v in env.items() if not k.startswith("FLYWHEEL_")}
    up = UpRun(config, run_dir, "--quiet", env=env, cwd=tmp).start()
    try:
        up.wait_ready(150)
        engine = up.procs()["engine-0"]["ready_url"].rsplit("/", 1)[0]
        post_json(f"{engine}/slow_down", {"forward_sleep_time": ENGINE_SLEEP_S})
        targets = wait_for(
            lambda: (u := metrics_urls(run_dir / "logs")) and len(u) == len(SERVICES) and u,
            10, "metrics URLs in the logs",
        )  # fmt: skip
        yield Live(up, config, tiny_model, env, targets)
    finally:
        up.stop()


@pytest.fixture(scope="module")
def prometheus(live: Live, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    with Prometheus(tmp_path_factory.mktemp("prometheus"), live.targets, RULES) as prom:
        yield prom


def test_every_service_metrics_pass_promtool(live: Live) -> None:
    for name, url in live.targets.items():
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "flywheel_" in text, name
        out = run([tool("promtool"), "check", "metrics"], input=text)
        assert out.returncode == 0, (name, out.stdout + out.stderr)


def test_every_dashboard_query_returns_series(live: Live, prometheus: Prometheus) -> None:
    # Let the loop turn: a few steps trained, weights made ready, targets up.
    wait_for(lambda: len(prometheus.query("up == 1")) == len(live.targets), 30, "every target up")
    wait_for(lambda: prometheus.query("flywheel_trainer_step >= 2")
             and prometheus.query("flywheel_sync_ready_version >= 1"), 90,
             "two trainer steps and a ready version")  # fmt: skip
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
        missing = {k: e for k, e in missing.items() if not prometheus.query(e)}
        if missing:
            time.sleep(1)  # Prometheus scrapes every second: the next scrape may have them
    assert not missing, "queries without data:\n" + "\n".join(
        f"  {k}: {e}" for k, e in missing.items()
    )


def test_status_and_an_added_worker_find_the_running_run(live: Live, tmp_path: Path) -> None:
    def status() -> dict:
        out = flywheel("status", "-c", str(live.config), "--json", env=live.env, cwd=tmp_path)
        return dict(json.loads(out.stdout))

    s = status()
    assert s["run"] == "live" and "engine-0" in s["engines"]
    # docs/operations.md's recipe, as written: an engine, and a worker told only its engine.
    port = free_port()
    extra = [start(["engine", "--model", str(live.model), "--port", str(port)],
                   tmp_path / "engine.log", live.env, tmp_path)]  # fmt: skip
    worker_env = {**live.env, "FLYWHEEL_ROLLOUT_ENGINE_URL": f"http://127.0.0.1:{port}",
                  "FLYWHEEL_ROLLOUT_ENGINE_ID": "engine-extra"}  # fmt: skip
    try:
        extra.append(start(["rollout", "-c", str(live.config)], tmp_path / "worker.log",
                           worker_env, live.config.parent))  # fmt: skip

        def caught_up() -> bool:  # sync brought the new engine to the run's weights
            s = status()
            e = s["engines"].get("engine-extra")
            return bool(e and e["version"] >= 1 and e["version"] >= (s["ready"] or 0) - 1)

        wait_for(caught_up, 120, "the added engine at the run's version", 1.0)
    finally:
        for p in extra:
            stop(p, signal.SIGTERM)
    worker_log = (tmp_path / "worker.log").read_text()
    assert "connected to 127.0.0.1" in worker_log and "Traceback" not in worker_log


def test_stopped_with_ctrl_c_it_exits_0_and_status_finds_no_run(live: Live) -> None:
    """Last in the module: it stops the run the other tests share."""
    code = live.up.stop()
    assert code == 0, live.up.output()[-3000:]
    gone = flywheel("status", "-c", str(live.config), env=live.env)
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1, gone.stderr
    assert "no run is up" in gone.stderr and not gone.stdout

"""A real Prometheus (Debian's binary) on loopback, scraping given targets every second.

With the repository's rules file, its groups evaluated every second too
(instead of every 30 s), so recording-rule panels have data within seconds.
The binary is found like the other deployment tools (tests/deploy/deploy_support.py:
the venv's bin, then PATH; `deploy/ci-tools.sh` installs it).
"""

from __future__ import annotations

import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from tests.harness.poll import wait_for
from tests.harness.ports import free_port
from tests.harness.probe import http_json, http_ok


class Prometheus:
    """`targets`: process name -> its metrics base URL (labels component and pod from the
    name, as the Kubernetes pods carry them). Use as a context manager."""

    def __init__(self, root: Path, targets: dict[str, str], rules: Path | None = None) -> None:
        from tests.deploy.deploy_support import run, tool

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "flywheel", "static_configs": [
                {"targets": [urllib.parse.urlparse(url).netloc],
                 "labels": {"component": name.split("-")[0], "pod": name}}
                for name, url in sorted(targets.items())
            ]}],
        }  # fmt: skip
        if rules is not None:
            doc = yaml.safe_load(rules.read_text())
            for g in doc["groups"]:
                g["interval"] = "1s"
            (root / "rules.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
            config["rule_files"] = [str(root / "rules.yml")]
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        check = run([tool("promtool"), "check", "config", str(root / "prometheus.yml")])
        assert check.returncode == 0, check.stdout + check.stderr
        self.binary = tool("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        log = self.root / "prometheus.log"
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.root / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, log.read_text()[-3000:]
            return http_ok(f"{self.url}/-/ready", timeout_s=2)

        wait_for(ready, 30, "prometheus ready", 0.25)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = http_json(url)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

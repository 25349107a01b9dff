"""HTTP probes of a running process: JSON, readiness, Prometheus samples.

Unreachable means None (or False), never an exception: a test polls these
while processes start, restart and die.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

UNREACHABLE = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)


def http_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def http_ok(url: str, timeout_s: float = 30.0) -> bool:
    """200 within `timeout_s` (an engine's /health_generate, like SGLang's, takes >= 1 s)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except UNREACHABLE:
        return False


def post_json(url: str, body: dict[str, Any], timeout_s: float = 10.0) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        assert r.status == 200, r.status
        raw = r.read()
    return json.loads(raw) if raw else None


def scrape(url: str, timeout_s: float = 2.0) -> str | None:
    """The Prometheus text at `url` (a /metrics URL); None when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return str(r.read().decode())
    except UNREACHABLE:
        return None


def metric(url: str, name: str, labels: str | None = None) -> float | None:
    """One sample of `name` at `url`: the one with exactly `labels` (`engine="engine-0"`),
    or without labels; None when unreachable or absent."""
    text = scrape(url)
    if text is None:
        return None
    want = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{\})?")
    m = re.search(rf"^{want} (?P<value>\S+)$", text, re.M)
    return float(m.group("value")) if m else None


def metric_sum(url: str, name: str) -> float | None:
    """The sum of `name`'s samples over all label sets; None when unreachable or absent."""
    text = scrape(url)
    if text is None:
        return None
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{.*\}})? (\S+)$",
                                                       text, re.M)]  # fmt: skip
    return sum(values) if values else None

"""Every stream, KV bucket and object store is created through services.runtime.nats_streams.

That module applies `[nats] replicas`; a stream created anywhere else would
silently have one replica on a cluster, and die with the server holding it.
"""

from __future__ import annotations

import re

from tests.harness import REPO

ROOT = REPO
CREATES = re.compile(r"\.(add_stream|update_stream|create_key_value|create_object_store)\(")


def test_only_nats_streams_creates_streams_and_buckets() -> None:
    allowed = ROOT / "services" / "runtime" / "nats_streams.py"
    sites = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for top in ("services", "proto")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path != allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if CREATES.search(line)
    ]
    assert sites == [], "create streams/buckets with nats_streams.ensure_*:\n" + "\n".join(sites)
    assert CREATES.search(allowed.read_text())  # the pattern does find the real sites

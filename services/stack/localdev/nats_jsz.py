"""Reading a JetStream cluster's state from a server's `/jsz` monitoring report.

Pure functions of the decoded JSON (`jsz` fetches it), so NatsCluster's
leader lookups and readiness waits are tested on real reports and the
parsing on plain dicts. The fields used, as nats-server 2.10+ writes them:
`meta_cluster.leader`, `meta_cluster.replicas[].{name,current,offline}`
(the leader's view of its peers) and, with `?streams=true`,
`account_details[].stream_detail[].{name,cluster.leader,state.messages}`
(only for the streams that server holds a replica of).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

UNREACHABLE: tuple[type[Exception], ...] = (urllib.error.URLError, OSError, ValueError)
"""What fetching a report from a server that is starting or going away raises."""


def jsz(monitor_url: str, query: str = "") -> dict[str, Any]:
    """A server's `/jsz` report (e.g. query "streams=true")."""
    url = f"{monitor_url}/jsz" + (f"?{query}" if query else "")
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        report: dict[str, Any] = json.load(resp)
    return report


def meta_leader(report: dict[str, Any]) -> str | None:
    """The meta group's leader as this server knows it (a server name)."""
    return (report.get("meta_cluster") or {}).get("leader") or None


def current_peers(report: dict[str, Any]) -> set[str]:
    """The peers a meta leader's report shows online and current."""
    peers = (report.get("meta_cluster") or {}).get("replicas") or []
    return {p["name"] for p in peers if p.get("current") and not p.get("offline")}


def streams(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream details of a `?streams=true` report, every account's."""
    return [s for a in report.get("account_details", []) for s in a.get("stream_detail", [])]


def stream_leaders(report: dict[str, Any]) -> dict[str, str | None]:
    """Stream name → its leader's server name (None while it has none)."""
    return {s["name"]: (s.get("cluster") or {}).get("leader") or None for s in streams(report)}


def stream_messages(report: dict[str, Any], stream: str) -> int | None:
    """Messages in this server's own replica of `stream`; None if it holds none."""
    for s in streams(report):
        if s["name"] == stream:
            return int(s["state"]["messages"])
    return None

"""Prometheus rules and Grafana dashboards against the services' real metrics.

The set of metric names comes from the services' own metric classes,
instantiated on a fresh CollectorRegistry each (not from grepping the
source): every series a family can produce (`_total`, `_bucket`, …) is
derived from its type. Every name a dashboard or rule uses must be in that
set, or be a recording rule defined in the rules file.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.deploy_support import DASHBOARDS, RULE_TESTS, RULES, load_script, run, tool

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created", ""),
}
# Series Prometheus itself adds to every target.
BUILTIN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset", "inf", "nan", "le"}  # fmt: skip


def service_registries() -> dict[str, object]:
    """One registry per service, holding exactly the metrics that service registers."""
    from prometheus_client import CollectorRegistry

    from services.buffer.metrics import BufferMetrics
    from services.rollout.metrics import RolloutMetrics
    from services.runtime.msgloop import LoopMetrics
    from services.sync.metrics import SyncMetrics
    from services.trainer.metrics import TrainerMetrics

    out: dict[str, object] = {}
    for name, cls in (("buffer", BufferMetrics), ("rollout", RolloutMetrics),
                      ("sync", SyncMetrics), ("trainer", TrainerMetrics)):  # fmt: skip
        r = CollectorRegistry()
        cls(r)
        LoopMetrics.for_registry(r)
        out[name] = r
    return out


def exported_names() -> set[str]:
    names: set[str] = set()
    for r in service_registries().values():
        for family in r.collect():  # type: ignore[attr-defined]
            names |= {family.name + s for s in SUFFIXES[family.type]}
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels removed)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    found = set()
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", e):
        if m[2] is None and m[1] not in PROMQL_WORDS:
            found.add(m[1])
    return found


def rules_doc() -> dict:
    return yaml.safe_load(RULES.read_text())


def recorded_names() -> set[str]:
    return {r["record"] for g in rules_doc()["groups"] for r in g["rules"] if "record" in r}


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every panel target."""
    out = []
    for f in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(f.read_text())["panels"]:
            for t in panel.get("targets", []):
                out.append((f.name, panel["title"], t["expr"]))
    return out


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (service, le) (rate(flywheel_handler_seconds_bucket"
        '{reason!~"a|b"}[$__rate_interval]))) or max by (engine) (x_y) * 0 > bool up'
    )
    assert metric_names(expr) == {"flywheel_handler_seconds_bucket", "x_y", "up"}


def test_promtool_check_rules() -> None:
    out = run([tool("promtool"), "check", "rules", str(RULES)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_test_rules() -> None:
    out = run([tool("promtool"), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_every_alert_has_a_unit_test() -> None:
    alerts = {r["alert"] for g in rules_doc()["groups"] for r in g["rules"] if "alert" in r}
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case.get("alert_rule_test", []) if t["exp_alerts"]
    }  # fmt: skip
    assert alerts == tested
    assert {"FlywheelTrainerStalled", "FlywheelStalenessHigh", "FlywheelSyncFailing",
            "FlywheelDeadLettersGrowing", "FlywheelEngineDown",
            "FlywheelNoSamplesFlowing"} <= alerts  # fmt: skip


@pytest.mark.parametrize("service", ["buffer", "rollout", "sync", "trainer"])
def test_promtool_check_metrics(service: str) -> None:
    """The exposition each service serves passes promtool's lint (names, units, help)."""
    from prometheus_client import generate_latest

    registry = service_registries()[service]
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    assert "flywheel_" in text
    out = run([tool("promtool"), "check", "metrics"], input=text)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_use_only_exported_metrics() -> None:
    known = exported_names() | recorded_names() | BUILTIN
    for g in rules_doc()["groups"]:
        for r in g["rules"]:
            unknown = metric_names(r["expr"]) - known
            assert not unknown, (r.get("record") or r.get("alert"), unknown)


def test_dashboards_use_only_exported_metrics() -> None:
    known = exported_names() | recorded_names()
    queries = dashboard_queries()
    assert len({d for d, _, _ in queries}) == 3 and len(queries) > 40
    for dashboard, title, expr in queries:
        names = metric_names(expr)
        assert names, (dashboard, title, expr)
        assert names <= known, (dashboard, title, names - known)


def test_dashboards_are_built_from_build_py() -> None:
    build = load_script(DASHBOARDS / "build.py")
    for d in build.DASHBOARDS:
        committed = (DASHBOARDS / f"{d.uid}.json").read_text()
        assert build.render(d) == committed, f"stale {d.uid}.json: run dashboards/build.py"


def test_dashboard_structure() -> None:
    for f in DASHBOARDS.glob("*.json"):
        d = json.loads(f.read_text())
        assert d["uid"] == f.stem
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids))
        for p in d["panels"]:
            if p["type"] == "row":
                continue
            assert p["datasource"]["uid"] == "${datasource}"
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs))

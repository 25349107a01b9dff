"""components/teacher: the teacher's engines on Kubernetes (distillation), rendered on the
cpu-dev overlay with a run file that names it, validated strictly, and wired: the workers'
[teacher] urls reach the Service, the Service the engine pods, the network policies both
ways, and the engine container loads its settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deploy_support import (
    KUBERNETES_VERSION,
    find,
    run,
    tool,
    with_component,
)

TEACHER = """
[teacher]
name = "smollm2-rl"
model = "/data/teacher"
engines = 0
urls = ["http://teacher:30000"]
concurrency = 8
timeout_s = 60

[trainer.distill]
coef = 1.0
reward_weight = 0.0
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    here = tmp_path_factory.mktemp("teacher-overlay")
    text, objs = with_component(here, "teacher", lambda toml: toml + TEACHER)
    manifest = here / "rendered.yaml"
    manifest.write_text(text)
    return manifest, objs


def test_it_validates_strictly(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    manifest, objs = rendered
    out = run([
        tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, str(manifest),
    ])  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert {("Deployment", "teacher"), ("Service", "teacher")} <= kinds


def test_workers_reach_the_teacher_engines(
    rendered: tuple[Path, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.engine.settings import EngineSettings
    from services.rollout.settings import RolloutSettings
    from services.runtime.settings import load_settings

    _, objs = rendered
    cm = next(o for o in objs if o["metadata"]["name"].startswith("flywheel-run"))
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(cm["data"]["run.toml"])
    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)
    rollout = load_settings(RolloutSettings, run_toml)
    assert rollout.teacher is not None and rollout.teacher.urls == ["http://teacher:30000"]

    dep = find(objs, "Deployment", "teacher")
    pod = dep["spec"]["template"]
    svc = find(objs, "Service", "teacher")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    port = next(p for p in engine["ports"] if p["name"] == svc["spec"]["ports"][0]["targetPort"])
    assert svc["spec"]["ports"][0]["port"] == port["containerPort"] == 30000
    assert "--model=/data/teacher" in engine["args"] and "--host=0.0.0.0" in engine["args"]
    assert engine["startupProbe"]["httpGet"]["path"] == "/health_generate"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    args = dict(a.removeprefix("--").split("=", 1) for a in engine["args"][1:])
    s = load_settings(EngineSettings, run_toml, model=args["model"])
    assert s.model == Path("/data/teacher")

    # ingress to the teacher from rollout pods; the rollout pods' egress opened to it
    ingress = find(objs, "NetworkPolicy", "teacher")["spec"]
    assert ingress["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert ingress["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "rollout"
    }
    egress = find(objs, "NetworkPolicy", "rollout-egress-teacher")["spec"]
    assert egress["egress"][0]["to"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "teacher"
    }
    assert egress["egress"][0]["ports"][0]["port"] == 30000

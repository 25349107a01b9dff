"""components/judge: the judge's engines beside a run, and the workers told to ask them.

Rendered on the cpu-dev overlay with a run file whose task mixes exact_match
with a judge part, validated strictly (kubernetes-validate), and read the
way the code reads it: the worker container's environment, resolved, loads
RolloutSettings with the judge's Service as its pool; the Service selects
the judge pods on the port the engine serves; the network lets the workers,
and only them, reach it.
"""

from __future__ import annotations

import os
import re
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

JUDGE_PART = (
    '\n[[task.reward]]\ntype = "judge"\nweight = 0.5\n'
    'rubric = "Is this reply polite? {completion}\\nAnswer yes or no."\nparse = "yes_no"\n'
)


def render(tmp_path: Path) -> tuple[list[dict[str, Any]], str]:
    def judged(toml: str) -> str:
        toml = toml.replace('reward = "exact_match"\n', "")
        return toml.replace("[task.eval]", '[[task.reward]]\nfn = "exact_match"\n' + JUDGE_PART
                            + "\n[task.eval]", 1)  # fmt: skip

    text, objs = with_component(tmp_path, "judge", judged)
    return objs, text


def test_judge_component_validates_and_wires_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.rollout.settings import RolloutSettings
    from services.runtime.settings import load_settings

    objs, text = render(tmp_path)
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(text)
    out = run([tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, str(manifest)])
    assert out.returncode == 0, out.stdout + out.stderr

    judge = find(objs, "Deployment", "judge")
    pod = judge["spec"]["template"]
    (engine,) = pod["spec"]["containers"]
    assert engine["args"][0] == "engine" and "--host=0.0.0.0" in engine["args"]
    port = {p["name"]: p["containerPort"] for p in engine["ports"]}["engine"]
    svc = find(objs, "Service", "judge")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["port"] == port == 30000
    # the rendered run file, and the worker's environment as the kubelet builds it
    cm = next(o for o in objs if o["metadata"]["name"].startswith("flywheel-run"))
    run_toml = tmp_path / "rendered-run.toml"
    run_toml.write_text(cm["data"]["run.toml"])
    rollout = find(objs, "Deployment", "rollout")["spec"]["template"]["spec"]
    worker = next(c for c in rollout["containers"] if c["name"] == "worker")
    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)
    for e in worker["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], re.sub(r"\$\((\w+)\)", "x", e["value"]))
    s = load_settings(RolloutSettings, run_toml)
    assert s.judged() and s.judge_urls() == (f"http://judge:{port}",)
    # the network: workers may reach the judge, and the judge takes only them
    ingress = find(objs, "NetworkPolicy", "judge")["spec"]
    assert ingress["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "judge"}
    assert [f["podSelector"]["matchLabels"] for f in ingress["ingress"][0]["from"]] == [
        {"app.kubernetes.io/name": "rollout"}
    ]
    egress = find(objs, "NetworkPolicy", "rollout-to-judge")["spec"]
    assert egress["egress"][0]["to"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "judge"
    }
    assert egress["egress"][0]["ports"][0]["port"] == port

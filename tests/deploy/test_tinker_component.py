"""components/tinker: the Tinker API server and its sampling engine on Kubernetes, rendered
on the cpu-dev overlay, validated strictly, and wired: the Service reaches the server's
port, the server loads its settings from the run file's ConfigMap with the pod's
environment, its `engines` is the engine container beside it, which serves LoRA up to
the server's max rank and reads the adapters at the path the server writes them; and the
image installs the `tinker` extra the server needs."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deploy_support import (
    KUBERNETES_VERSION,
    ROOT,
    find,
    run,
    tool,
    with_component,
)

TINKER = """
[tinker]
max_rank = 32
lora_alpha = 16
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    here = tmp_path_factory.mktemp("tinker-overlay")
    text, objs = with_component(here, "tinker", lambda toml: toml + TINKER)
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
    assert {("Deployment", "tinker"), ("Service", "tinker"), ("NetworkPolicy", "tinker")} <= kinds


def _args(container: dict[str, Any]) -> dict[str, str]:
    return dict(a.removeprefix("--").partition("=")[::2] for a in container["args"][1:])


def test_the_server_samples_on_the_engine_beside_it(
    rendered: tuple[Path, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.engine.settings import EngineSettings
    from services.runtime.settings import load_settings
    from services.tinker.settings import TinkerSettings

    _, objs = rendered
    cm = next(o for o in objs if o["metadata"]["name"].startswith("flywheel-run"))
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(cm["data"]["run.toml"])
    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)

    pod = find(objs, "Deployment", "tinker")["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    server, engine = containers["tinker"], containers["engine"]
    assert server["args"][0] == "tinker" and engine["args"][0] == "engine"

    # The Service reaches the server's port; the server listens on it, on every address.
    svc = find(objs, "Service", "tinker")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = [p for p in server["ports"] if p["name"] == svc["spec"]["ports"][0]["targetPort"]]
    args = _args(server)
    assert svc["spec"]["ports"][0]["port"] == port["containerPort"] == int(args["port"])
    assert server["readinessProbe"]["httpGet"]["path"] == "/api/v1/healthz"

    # The server's settings: the run file's [tinker] table, the pod's environment.
    for e in server["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    s = load_settings(TinkerSettings, run_toml, model=args["model"], host=args["host"])
    assert (s.max_rank, s.lora_alpha, s.host) == (32, 16.0, "0.0.0.0")
    key = next(e for e in server["env"] if e["name"] == "FLYWHEEL_TINKER_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True  # a key if the Secret exists

    # Its engine is the container beside it: LoRA on, every rank the server accepts.
    engine_args = _args(engine)
    (engine_port,) = [p["containerPort"] for p in engine["ports"] if p["name"] == "engine"]
    assert s.engines == [f"http://127.0.0.1:{engine_port}"] and engine_args["port"] == "30000"
    monkeypatch.delenv("FLYWHEEL_TINKER_ENGINES")
    e = load_settings(
        EngineSettings,
        run_toml,
        model=engine_args["model"],
        enable_lora=True,
        max_lora_rank=int(engine_args["max-lora-rank"]),
        lora_target_modules=[engine_args["lora-target-modules"]],
    )
    assert e.lora is not None and e.lora.max_rank >= s.max_rank
    assert e.model == Path(args["model"])  # one base model: the server's and the engine's

    # The engine reads the adapters where the server writes them: one volume, one path.
    def mount_of(c: dict[str, Any], path: Path) -> str:
        (m,) = [m for m in c["volumeMounts"] if path.is_relative_to(m["mountPath"])]
        return str(m["name"])

    samplers = Path(s.state_dir) / ".samplers"
    assert mount_of(server, samplers) == mount_of(engine, samplers) == "data"
    writable = next(m for m in server["volumeMounts"] if m["name"] == "data")
    assert not writable.get("readOnly", False)  # save_state and the samplers write there


def test_only_the_server_port_is_opened(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, objs = rendered
    policy = find(objs, "NetworkPolicy", "tinker")["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "tinker"}
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == [8000]


def test_the_image_installs_the_tinker_extra() -> None:
    line = re.search(r'^RUN pip install "\.\[([a-z,]+)\]"', (ROOT / "Dockerfile").read_text(), re.M)
    assert line is not None and "tinker" in line[1].split(",")
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "tinker" in extras

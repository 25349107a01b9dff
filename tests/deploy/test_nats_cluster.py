"""The nats-cluster component: three routed JetStream servers, and a run file that uses them.

The overlay cpu-dev-cluster renders and validates with every other overlay
(test_manifests parametrizes over them all); here: the cluster is wired the
way nats-server needs (one route per pod by its stable DNS name, on the port
the headless service and the container declare, a PVC and a server name per
pod, started together), the run file replicates every stream on all of the
servers, and every rendered nats.conf is one the real nats-server accepts.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deploy_support import K8S, OVERLAYS, find, objects, run_file

CLUSTER = "cpu-dev-cluster"


def nats_conf(objs: list[dict[str, Any]]) -> str:
    configs = [o for o in objs if o["metadata"]["name"].startswith("nats-config")]
    assert len(configs) == 1 and configs[0]["kind"] == "ConfigMap", configs
    return str(configs[0]["data"]["nats.conf"])


def named_port(ports: list[dict[str, Any]], name: str, key: str = "containerPort") -> int:
    return int(next(p[key] for p in ports if p["name"] == name))


def test_the_cluster_overlay_exists_and_uses_the_component() -> None:
    assert CLUSTER in OVERLAYS
    text = (K8S / "overlays" / CLUSTER / "kustomization.yaml").read_text()
    assert "../../components/nats-cluster" in text


def test_three_servers_routed_by_their_stable_names() -> None:
    objs = objects(CLUSTER)
    sts = find(objs, "StatefulSet", "nats")
    replicas = sts["spec"]["replicas"]
    assert replicas == 3
    # Started together: a new cluster elects its meta leader only with every route up.
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "jetstream"
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    route_port = named_port(container["ports"], "cluster")
    headless = find(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert named_port(headless["spec"]["ports"], "cluster", "port") == route_port

    conf = nats_conf(objs)
    assert re.search(r"^server_name: \$POD_NAME$", conf, re.M)
    cluster = re.search(r"^cluster \{(.*?)^\}", conf, re.M | re.S)
    assert cluster is not None, conf
    assert re.search(rf"^\s*port: {route_port}$", cluster[1], re.M)
    routes = re.findall(r"nats://\S+", cluster[1])
    name, svc = sts["metadata"]["name"], headless["metadata"]["name"]
    assert routes == [f"nats://{name}-{i}.{svc}:{route_port}" for i in range(replicas)]


def test_losing_one_server_is_allowed_and_routes_are_let_through() -> None:
    objs = objects(CLUSTER)
    pdb = find(objs, "PodDisruptionBudget", "nats")
    assert pdb["spec"]["maxUnavailable"] == 1  # 2 of 3 remain: a JetStream majority
    policy = find(objs, "NetworkPolicy", "nats")
    route = {"port": 6222, "protocol": "TCP"}
    route_rules = [r for r in policy["spec"]["ingress"] if route in r["ports"]]
    assert route_rules == [
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nats"}}}],
            "ports": [{"port": 6222, "protocol": "TCP"}],
        }
    ]


def test_the_cluster_run_file_replicates_every_stream_on_every_server() -> None:
    objs = objects(CLUSTER)
    cfg = run_file(objs)
    assert cfg["nats"]["replicas"] == find(objs, "StatefulSet", "nats")["spec"]["replicas"]
    # Otherwise cpu-dev's run, so the two cannot drift apart unnoticed.
    base = run_file(objects("cpu-dev"))
    assert {**cfg, "nats": {k: v for k, v in cfg["nats"].items() if k != "replicas"}} == base
    # What a service would load (test_manifests loads each container's settings too).
    from services.runtime.settings import NatsSettings

    assert NatsSettings(**cfg["nats"]).replicas == 3


def test_single_server_overlays_keep_one_replica() -> None:
    for overlay in OVERLAYS:
        objs = objects(overlay)
        if find(objs, "StatefulSet", "nats")["spec"]["replicas"] == 1:
            assert run_file(objs)["nats"].get("replicas", 1) == 1, overlay
            assert "cluster {" not in nats_conf(objs), overlay


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendered_nats_conf_is_valid_for_nats_server(overlay: str, tmp_path: Path) -> None:
    from services.stack.localdev.nats_server import find_nats_server

    objs = objects(overlay)
    (cm,) = [o for o in objs if o["metadata"]["name"].startswith("nats-config")]
    for name, text in cm["data"].items():  # nats.conf includes nats-auth.conf beside it
        (tmp_path / name).write_text(text)
    conf = tmp_path / "nats.conf"
    env = {**os.environ, "POD_NAME": "nats-0"}
    for service in ("buffer", "rollout", "trainer", "sync"):  # as the Secret sets them
        env[f"FLYWHEEL_NATS_{service.upper()}_PASSWORD"] = f"p-{service}"
    argv = [str(find_nats_server()), "-t", "-c", str(conf)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, check=False)
    assert out.returncode == 0 and "is valid" in out.stdout + out.stderr, out.stderr

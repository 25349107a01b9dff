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
    # the same run but for the replicas and TLS (the cluster speaks only TLS)
    same = {k: v for k, v in cfg["nats"].items() if k not in ("replicas", "tls_ca")}
    assert {**cfg, "nats": {**same, "url": same["url"].replace("tls://", "nats://")}} == base
    # What a service would load (test_manifests loads each container's settings too).
    from services.runtime.settings import NatsSettings

    assert NatsSettings(**cfg["nats"]).replicas == 3


def test_single_server_overlays_keep_one_replica() -> None:
    for overlay in OVERLAYS:
        objs = objects(overlay)
        if find(objs, "StatefulSet", "nats")["spec"]["replicas"] == 1:
            assert run_file(objs)["nats"].get("replicas", 1) == 1, overlay
            assert "cluster {" not in nats_conf(objs), overlay


def _unpacked(objs: list[dict[str, Any]], into: Path) -> Path:
    """The nats-config ConfigMap's files (nats.conf includes nats-auth.conf beside it) and
    the nats-tls Secret's, written under `into` as the pod mounts them; nats.conf's path."""
    import base64

    (cm,) = [o for o in objs if o["metadata"]["name"].startswith("nats-config")]
    tls = [
        o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].startswith("nats-tls")
    ]
    for secret in tls:
        (into / "tls").mkdir()
        for name, data in secret["data"].items():
            (into / "tls" / name).write_bytes(base64.b64decode(data))
    for name, text in cm["data"].items():
        (into / name).write_text(text.replace("/etc/nats-tls/", f"{into / 'tls'}/"))
    return into / "nats.conf"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendered_nats_conf_is_valid_for_nats_server(overlay: str, tmp_path: Path) -> None:
    from services.stack.localdev.nats_server import find_nats_server

    objs = objects(overlay)
    conf = _unpacked(objs, tmp_path)
    env = {**os.environ, "POD_NAME": "nats-0"}
    for service in ("buffer", "rollout", "trainer", "sync"):  # as the Secret sets them
        env[f"FLYWHEEL_NATS_{service.upper()}_PASSWORD"] = f"p-{service}"
    argv = [str(find_nats_server()), "-t", "-c", str(conf)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, check=False)
    assert out.returncode == 0 and "is valid" in out.stdout + out.stderr, out.stderr


def test_the_cluster_speaks_tls_only_and_the_services_verify_it(
    tmp_path: Path, run_async: Any
) -> None:
    """A real nats-server with the cluster's client TLS (its generated certificate): the
    services' settings (tls:// URL, the mounted CA) connect; plain or unverified do not."""
    from services.runtime.nats_conn import NatsConnectError, connect
    from services.runtime.settings import NatsSettings
    from services.stack.localdev.nats_server import NatsServer

    objs = objects(CLUSTER)
    text = _unpacked(objs, tmp_path).read_text()
    block = re.search(r"^tls \{.*?^\}", text, re.M | re.S)
    assert block is not None, "no client tls block"
    ran = run_file(objs)["nats"]
    assert ran["url"].startswith("tls://") and ran["tls_ca"] == "/etc/nats-tls/ca.crt"
    for workload, kind in (("buffer", "Deployment"), ("sync", "Deployment"),
                           ("rollout", "Deployment"), ("trainer", "StatefulSet")):  # fmt: skip
        pod = find(objs, kind, workload)["spec"]["template"]["spec"]
        ca = next(v for v in pod["volumes"] if v["name"] == "nats-ca")["secret"]
        assert ca["secretName"].startswith("nats-tls") and ca["items"] == [
            {"key": "ca.crt", "path": "ca.crt"}]  # fmt: skip
        mounts = [m for c in pod["containers"] for m in c.get("volumeMounts", [])]
        assert {"name": "nats-ca", "mountPath": "/etc/nats-tls", "readOnly": True} in mounts

    async def roundtrip(settings: NatsSettings) -> None:
        nc = await connect(settings, "tls-check")
        await nc.flush()
        await nc.close()

    with NatsServer(config=block.group(0)) as server:
        port = server.url.rsplit(":", 1)[1]
        ok = NatsSettings(url=f"tls://localhost:{port}", tls_ca=tmp_path / "tls/ca.crt",
                          connect_attempts=1)  # fmt: skip
        run_async(roundtrip(ok))
        for bad in (
            ok.model_copy(update={"url": f"nats://localhost:{port}", "tls_ca": None}),
            ok.model_copy(update={"tls_ca": tmp_path / "tls/tls.crt"}),  # not the CA
        ):
            with pytest.raises(NatsConnectError):
                run_async(roundtrip(bad.model_copy(update={"connect_timeout_s": 2})))

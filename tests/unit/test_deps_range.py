"""The dependency ranges pyproject.toml declares are the ones tested.

`make test-deps` runs the engine's, trainer's and runtime's tests on the lowest
transformers and nats-py the ranges allow: the Makefile's TRANSFORMERS_LOWEST and
NATS_PY_LOWEST must be those lower bounds, or raising one would leave the old release
tested. Every runtime dependency has an upper
bound (the next major: a release nobody has read must not be installed silently).
"""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.harness import REPO


def dependencies() -> dict[str, str]:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    out = {}
    for dep in doc["project"]["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", dep)
        assert m is not None, dep
        out[m.group(1).lower()] = m.group(2)
    return out


def release(version: str) -> tuple[int, ...]:
    """'5.0' and '5.0.0' alike: (5, 0, 0)."""
    parts = [int(x) for x in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


LOWEST = [("transformers", "TRANSFORMERS_LOWEST"), ("nats-py", "NATS_PY_LOWEST")]


@pytest.mark.parametrize(("package", "variable"), LOWEST)
def test_make_test_deps_tests_the_lower_bound(package: str, variable: str) -> None:
    spec = dependencies()[package]
    lower = re.search(r">=\s*([0-9.]+)", spec)
    assert lower is not None, spec
    make = re.search(rf"^{variable} := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert make is not None, f"Makefile: {variable}"
    assert release(make.group(1)) == release(lower.group(1)), (make.group(1), spec)


def test_every_api_flywheel_leans_on_has_an_upper_bound() -> None:
    deps = dependencies()
    leaned_on = [
        "torch", "transformers", "tokenizers", "safetensors", "numpy", "msgpack",
        "pydantic", "pydantic-settings", "nats-py", "aiohttp", "prometheus-client",
    ]  # fmt: skip
    unbounded = [d for d in leaned_on if "<" not in deps[d]]
    assert not unbounded, unbounded

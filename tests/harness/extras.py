"""Tests that need an optional extra (`pip install 'flywheel[verifiers]'`).

Without the extra they skip, saying so — except where the extra was installed
for them (`make test-verifiers`, which .ci/run runs: FLYWHEEL_VERIFIERS_TESTS=
required): there a missing or broken install fails, rather than skipping
every test of it unseen.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_verifiers() -> ModuleType:
    """The `verifiers` package; skip (fail where required) without it."""
    if os.environ.get("FLYWHEEL_VERIFIERS_TESTS") == "required":
        try:
            return importlib.import_module("verifiers")
        except ImportError as e:
            pytest.fail(f"the verifiers extra is not installed (make test-verifiers): {e}")
    return pytest.importorskip("verifiers")


def require_verifiers_v1() -> ModuleType:
    """`verifiers.v1` as Flywheel runs it (verifiers>=0.3.1; 0.2.1 ships an early, other
    `verifiers.v1`): skip with an older release, fail where required."""
    from services.tasks.verifiers_v1 import MIN_VERSION, version_of

    installed = str(getattr(require_verifiers(), "__version__", "0"))
    if version_of(installed) < MIN_VERSION:
        why = f"verifiers {installed} is older than the v1 API Flywheel runs (0.3.1)"
        if os.environ.get("FLYWHEEL_VERIFIERS_TESTS") == "required":
            pytest.fail(why)
        pytest.skip(why, allow_module_level=True)
    return importlib.import_module("verifiers.v1")

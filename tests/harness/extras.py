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
    """`verifiers.v1` (verifiers>=0.3.1); skip without it (0.2.x has none), fail where required."""
    require_verifiers()
    if os.environ.get("FLYWHEEL_VERIFIERS_TESTS") == "required":
        try:
            return importlib.import_module("verifiers.v1")
        except ImportError as e:
            pytest.fail(f"verifiers.v1 is missing (the extra wants >=0.3.1): {e}")
    return pytest.importorskip("verifiers.v1")

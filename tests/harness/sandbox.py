"""The sandbox in tests: pools that can import the tests' own modules, and the rule for
tests that need bubblewrap.

`TESTS`: a pool's sandbox showing the `tests` package (where the fixtures'
rewards and tools live) that falls back to plain processes on a host without
one: for tests of the pools' behaviour (hangs, raises, deaths), which hold
either way.

`require_sandbox()`: for tests of the walls themselves (the escape battery).
Where the host cannot give a sandbox they skip, saying why — except in CI
(`CI` set, as CI runners do, or FLYWHEEL_SANDBOX_TESTS=required), where
`make tools` has installed bubblewrap and a skip would hide a hole: there
they fail.
"""

from __future__ import annotations

import os

import pytest

from services.tasks.jail import Sandbox, probe

TESTS = Sandbox(modules=("tests",), required_by=())
CONFINED = Sandbox(modules=("tests",))


def require_sandbox() -> None:
    reason = probe()
    if reason is None:
        return
    strict = os.environ.get("FLYWHEEL_SANDBOX_TESTS") == "required"
    if strict or os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"the sandbox is unavailable on this CI host: {reason}")
    pytest.skip(f"no sandbox on this host ({reason}); apt-get install bubblewrap")

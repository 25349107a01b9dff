"""The escape battery again, as every Kubernetes pod runs the sandbox: the children are
started by a `flywheel sandbox` server running as the pod's non-root uid (10001: no
groups, no capabilities, no cgroup), so bubblewrap makes a user namespace and every
call shares that uid (tests/harness/sandbox.py `PodServer`). Each case of
test_escapes.py runs here unchanged; `mode` tells the few that differ by mode
(the uid a call sees). A module of its own, so that `make test`'s workers run the
two modes side by side.
"""

from __future__ import annotations

import pytest

from tests.harness.sandbox import require_pod_sandbox
from tests.integration.sandbox.test_escapes import (  # noqa: F401 -- collected here too
    host,
    pools,
    test_a_calls_processes_share_one_memory_limit,
    test_a_completion_cannot_change_its_siblings_rewards,
    test_a_tools_secret_reaches_only_its_own_calls,
    test_after_a_cancelled_call_every_call_gets_its_own_answer,
    test_escape_is_refused,
)


@pytest.fixture(scope="module")
def mode() -> str:
    require_pod_sandbox()
    return "pod"

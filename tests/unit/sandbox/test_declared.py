"""The sandbox knows no task by name: the reward and tool modules declare themselves
(`every_child_imports`, `tool_warmup`) as they are imported, and every child of a pool
then imports them before it serves, as the zygote's own imports once did."""

from __future__ import annotations

from typing import Any

import pytest

import services.tasks.scoring  # noqa: F401 -- what the services import: it declares both
from services.runtime.errors import ConfigError
from services.sandbox import ToolPool, VerifierPool
from services.tasks import tools
from tests.harness.sandbox import TESTS

HOLDS = "tests.unit.sandbox.loaded:holds"
ENTRY_POINTS = ["services.tasks.rewards", "services.tasks.tools"]


def test_every_child_holds_the_declared_entry_points(run_async: Any) -> None:
    async def body() -> None:
        warm = [(HOLDS, (ENTRY_POINTS,))]
        async with VerifierPool(size=1, timeout_s=5.0, warmup=warm, sandbox=TESTS) as pool:
            assert pool.confined is not None  # started: the warm-up found both imported
        async with ToolPool(size=1, timeout_s=5.0, sandbox=TESTS) as pool:
            # its children ran the declared warm-up (by the tools' names only), and serve
            assert pool.warmup == ((tools.WARM, ([],)),)
            out = await pool.run(tools.CALL, {"type": "calculator", "limit": 10**6}, "6*7")
            assert (out.text, out.error) == ("42", None), out

    run_async(body(), timeout_s=120)


def test_a_module_nobody_declared_is_not_there(run_async: Any) -> None:
    """The check above can fail: a warm-up asking for a module no one declared."""

    async def body() -> None:
        warm = [(HOLDS, (["tests.unit.sandbox.never_declared"],))]
        with pytest.raises(ConfigError, match="never_declared"):
            async with VerifierPool(size=1, timeout_s=5.0, warmup=warm, sandbox=TESTS):
                pass

    run_async(body(), timeout_s=120)

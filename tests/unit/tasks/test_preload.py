"""A sandbox child's start-up never counts against a call's time limit: it serves only once
it has answered the preload (its interpreter started, the pool's PRELOAD imported), so a
module that takes longer to import than the limit costs the pool's start, not a call."""

from __future__ import annotations

from typing import Any

from services.sandbox import VerifierPool
from tests.harness.sandbox import TESTS

SLOW = "tests.unit.tasks.slow_import"
LIMIT_S = 1.0  # the module's import sleeps 1.5 s


class Preloading(VerifierPool):
    PRELOAD = (*VerifierPool.PRELOAD, SLOW)


def test_a_preloaded_import_is_not_charged_to_the_first_call(run_async: Any) -> None:
    async def body() -> None:
        async with Preloading(size=1, timeout_s=LIMIT_S, sandbox=TESTS) as pool:
            r = await pool.call(f"{SLOW}:loaded", "x", None)
        assert (r.reward, r.error) == (1.0, None), r
        # The same call in a pool that does not preload it pays the import within its limit.
        async with VerifierPool(size=1, timeout_s=LIMIT_S, sandbox=TESTS) as pool:
            r = await pool.call(f"{SLOW}:loaded", "x", None)
        assert r.error is not None and "timed out" in r.error, r

    run_async(body(), timeout_s=120)

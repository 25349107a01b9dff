"""The LLM judge over its engines: one way to build it, for every command that judges.

A `Judge` (judge.py) asks through a chat function; here that function is a
`ChatPool` (services/engine_api/chat_pool.py) over the `[judge]` table's
engines, with the table's concurrency, time limit, retries and key, and the
pool's failures turned into the judge's dead-letter reasons. The rollout
worker judges its live samples with it, and `flywheel replay rescore` the
recorded ones: built in one place, a rescore asks the judge exactly as the
run's workers did.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from services.engine_api.chat_pool import ChatFailed, ChatPool
from services.tasks.judge import (
    REFUSED,
    TIMEOUT,
    UNAVAILABLE,
    UNPARSABLE,
    Chat,
    Judge,
    JudgeCallFailed,
    JudgeMetrics,
    JudgeSettings,
)

# The pool's failure reasons as the judge's dead-letter reasons.
_REASONS = {
    "timeout": TIMEOUT,
    "unavailable": UNAVAILABLE,
    "refused": REFUSED,
    "malformed": UNPARSABLE,
}


def judge_chat(pool: ChatPool) -> Chat:
    """The judge's chat function over `pool`: its failures as JudgeCallFailed."""

    async def chat(body: dict[str, Any]) -> str:
        try:
            return await pool.chat(body)
        except ChatFailed as e:
            raise JudgeCallFailed(_REASONS[e.reason], str(e)) from e

    return chat


@contextlib.asynccontextmanager
async def judge_over(
    j: JudgeSettings, urls: Sequence[str], metrics: JudgeMetrics | None = None
) -> AsyncIterator[Judge]:
    """A `Judge` asking the engines at `urls` as `[judge]` says; `metrics`: the service's
    `flywheel_judge_*` (None: not counted)."""
    async with ChatPool(
        urls,
        concurrency=j.concurrency,
        timeout_s=j.timeout_s,
        retries=j.retries,
        backoff_s=j.backoff_s,
        api_key=j.api_key.get_secret_value() if j.api_key else None,
        observe=metrics.request_done if metrics is not None else None,
    ) as pool:
        if metrics is not None:
            metrics.in_flight.set_function(lambda: pool.in_flight)
            metrics.waiting.set_function(lambda: pool.waiting)
        yield Judge(judge_chat(pool), j.cache_size, metrics)

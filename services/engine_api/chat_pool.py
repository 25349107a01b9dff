"""A pool of engines asked through SGLang's OpenAI-compatible `/v1/chat/completions`.

What an LLM judge runs on (services/tasks/judge.py): one request is one
short chat, sent to whichever engine of the pool has the fewest requests
of ours in flight (ties: round robin), so more engines answer more
requests at once. The pool bounds what it asks of them:

- `concurrency`: requests in flight at once from this pool; more wait
  their turn (`waiting`), so a slow judge holds the requests, not the
  engines' queues;
- `timeout_s`: one attempt's limit (an engine that never answers costs
  that, not a stalled worker);
- `retries`: further attempts after a timeout, an unreachable engine, a
  5xx or a 429, each on the least-loaded engine but the one that just
  failed (when there is another), after `backoff_s` doubled each time. A
  judge request changes nothing on the engine, so sending it again is
  safe. Any other 4xx is the engine refusing the request itself (a bad
  field, a prompt over its context): not retried.

Failures are `ChatFailed` with a `reason` ("timeout", "unavailable",
"refused", "malformed": an answer not in the chat-completions shape).
`observe(engine, outcome, seconds)` hears every attempt.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.engine_api.engine_client import (
    EngineClient,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
)
from services.runtime.errors import FlywheelError

CHAT = "/v1/chat/completions"


class ChatFailed(FlywheelError, RuntimeError):
    """No answer from the pool: `reason` is timeout, unavailable, refused or malformed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def reply_text(doc: Any) -> str:
    """The first choice's message content of a chat-completions answer (SGLang's shape)."""
    try:
        content = doc["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as e:
        raise ChatFailed("malformed", f"not a chat-completions answer: {str(doc)[:200]}") from e
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ChatFailed("malformed", f"message content is not text: {str(content)[:200]}")
    return content


class ChatPool:
    """Engines behind /v1/chat/completions, asked least-loaded first. `async with` it."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        concurrency: int = 8,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        api_key: str | None = None,
        observe: Callable[[str, str, float], None] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("a chat pool needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.observe = observe
        # Connection errors are the pool's to retry (on another engine): the client's own
        # retries would hold a request on a dead engine.
        self.clients = [EngineClient(u, timeout_s=timeout_s, retries=0, api_key=api_key)
                        for u in self.urls]  # fmt: skip
        self.loads = [0] * len(self.urls)  # our requests in flight, per engine
        self._turn = itertools.count()
        self._slots = asyncio.Semaphore(concurrency)
        self.waiting = 0  # requests queued for a slot
        self.in_flight = 0

    async def __aenter__(self) -> ChatPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

    def pick(self, avoid: int | None = None) -> int:
        """The engine with the fewest of our requests in flight; ties in turn; `avoid` (the
        one that just failed) only when it is the only one."""
        turn = next(self._turn)
        n = len(self.urls)
        order = [(turn + k) % n for k in range(n)]
        candidates = [i for i in order if i != avoid] or order
        return min(candidates, key=lambda i: self.loads[i])

    async def chat(self, body: dict[str, Any]) -> str:
        """The reply's text; ChatFailed once the attempts are spent or on a refusal."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.in_flight += 1
        try:
            return await self._attempts(body)
        finally:
            self.in_flight -= 1
            self._slots.release()

    async def _attempts(self, body: dict[str, Any]) -> str:
        failed: int | None = None
        last = ChatFailed("unavailable", "no attempt made")
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            i = self.pick(avoid=failed)
            try:
                return await self._one(i, body)
            except ChatFailed as e:
                if e.reason in ("refused", "malformed"):
                    raise
                failed, last = i, e
        tries = self.retries + 1
        raise ChatFailed(last.reason, f"{last} ({tries} attempt{'s' * (tries > 1)})")

    async def _one(self, i: int, body: dict[str, Any]) -> str:
        import aiohttp

        url = self.urls[i]
        self.loads[i] += 1
        t0 = time.monotonic()
        outcome = "ok"
        try:
            doc = await self.clients[i].request("POST", CHAT, body, timeout_s=self.timeout_s)
            return reply_text(doc)
        except EngineTimeout as e:
            outcome = "timeout"
            raise ChatFailed("timeout", f"{url}: no answer in {self.timeout_s:g}s") from e
        except EngineUnavailable as e:
            outcome = "unavailable"
            raise ChatFailed("unavailable", f"{url}: unreachable: {e}") from e
        except EngineHTTPError as e:
            retry = e.status >= 500 or e.status == 429
            outcome = "unavailable" if retry else "refused"
            raise ChatFailed(outcome, f"{url} answered {e.status}: {e.message}") from e
        except ChatFailed:
            outcome = "malformed"
            raise
        except aiohttp.ClientError as e:  # a broken answer (payload, headers): try another
            outcome = "unavailable"
            raise ChatFailed("unavailable", f"{url}: {type(e).__name__}: {e}") from e
        except ValueError as e:  # a body that says it is JSON and is not
            outcome = "malformed"
            raise ChatFailed("malformed", f"{url}: answer is not JSON: {e}") from e
        finally:
            self.loads[i] -= 1
            if self.observe is not None:
                self.observe(url, outcome, time.monotonic() - t0)

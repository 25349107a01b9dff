"""A real judge engine for tests: an aiohttp server answering `/v1/chat/completions`.

A tiny model is no judge, so the tests' judge applies a rule to the text it
is asked about (`rule`: the completion, found in the rubric between markers,
to a reply string) and answers in the chat-completions shape SGLang and the
CPU engine answer in (the CPU engine's own `chat_response`). It can also
hang (never answer) or answer garbage, counts the requests it received and
the most it had in flight at once (`tally`, which servers may share) and
working past its queue (`working`, likewise), and
can take `delay_s` over each answer, `capacity` at a time. Served in the test's event loop
(`serving`), or on a thread of its own (`in_thread`) for tests whose
processes are driven synchronously.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.engine.core import openai_protocol as oa

BEGIN, END = "<<<", ">>>"
RUBRIC = f"Grade the reply to: {{prompt}}\nReply: {BEGIN}{{completion}}{END}\nScore 0-10:"
_GRADED = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.S)


def graded(messages: list[dict[str, Any]]) -> str:
    """The completion a rubric built on RUBRIC asks about."""
    m = _GRADED.search(str(messages[-1].get("content", "")))
    return m.group(1) if m else ""


@dataclass
class Tally:
    """Requests in flight now and at most, over every server that shares it."""

    now: int = 0
    most: int = 0


@dataclass
class JudgeServer:
    rule: Callable[[str], str] = lambda text: "score: 5"
    mode: str = "rule"  # "rule", "hang" (never answers), "garbage" or "refuse" (a 400)
    delay_s: float = 0.0
    capacity: int = 0  # answers it works on at once (more wait, as in an engine's queue); 0: any
    requests: int = 0
    tally: Tally = field(default_factory=Tally)  # share one among servers to count a pool
    working: Tally = field(default_factory=Tally)  # answers being worked on (past the queue)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    _busy: asyncio.Semaphore | None = None

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        self.bodies.append(body)
        t = self.tally
        t.now += 1
        t.most = max(t.most, t.now)
        try:
            if self.mode == "hang":
                await asyncio.Event().wait()
            if self.mode == "refuse":  # SGLang's ErrorResponse for a request it will not run
                err = {"object": "error", "message": "bad request", "type": "BadRequestError",
                       "param": None, "code": 400}  # fmt: skip
                return web.json_response(err, status=400)
            if self.delay_s:
                await self._work()
            reply = (
                "¯\\_(ツ)_/¯ lorem"
                if self.mode == "garbage"
                else self.rule(graded(body["messages"]))
            )
        finally:
            t.now -= 1
        n = len(reply)
        meta = {"id": f"judge-{self.requests}", "prompt_tokens": 1, "completion_tokens": n,
                "weight_version": "0", "finish_reason": {"type": "stop"}}  # fmt: skip
        outs = [{"text": reply, "output_ids": list(range(n)), "meta_info": meta}]
        return web.json_response(oa.chat_response(body, outs, [0], str))

    async def _work(self) -> None:
        if not self.capacity:
            await asyncio.sleep(self.delay_s)
            return
        if self._busy is None:  # made in the server's own event loop
            self._busy = asyncio.Semaphore(self.capacity)
        async with self._busy:
            self.working.now += 1
            self.working.most = max(self.working.most, self.working.now)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.working.now -= 1

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app


@contextmanager
def in_thread(server: JudgeServer) -> Iterator[str]:
    """Serve `server` on 127.0.0.1 from a thread with its own event loop; yields its URL."""
    from tests.harness.engines import serving

    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Event | None = None
    url = ""

    async def main() -> None:
        nonlocal stop, url
        stop = asyncio.Event()
        async with serving(server.app()) as u:
            url = u
            started.set()
            await stop.wait()

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    assert started.wait(30), "judge server did not start"
    try:
        yield url
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        t.join(30)

"""Flywheel's harness for verifiers v1 environments: the chat loop, in-process.

verifiers' own tool-less loop (`null`) and its default (`bash`) run a PEP 723
script through `uv sync --script`, which downloads their dependencies at run
time: Flywheel never downloads at run time. verifiers allows a harness to
run its loop in-process as long as every model call goes through the
interception endpoint (`Harness.launch`'s contract), which is all this one
does: one segment = one chat completion on the conversation so far. The
env's control flow (an `Env.run` with interactions, a user simulator, a
multi-agent env) makes the turns; the interception server records them.

Imported only by services.tasks.verifiers_v1 (it imports `verifiers`).
verifiers resolves a harness id by importing a top-level module, so that
module registers this one under HARNESS_ID.
"""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HARNESS_ID = "flywheel_chat"  # the top-level module name verifiers imports (sys.modules alias)


class FlywheelChatConfig(vf.HarnessConfig):
    """No knobs: sampling is the run's, the engine is the client's."""


class FlywheelChatHarness(vf.Harness[FlywheelChatConfig]):
    """One chat completion per segment through the interception endpoint; no tools."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # resume() relaunches on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        if mcp_urls:
            return vf.ProgramResult(1, "", "the flywheel_chat harness offers no tools (MCP)")
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = []
        if system:
            messages.append({"role": "system", "content": system})
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [_wire(m) for m in prompt]
        if not messages:
            return vf.ProgramResult(1, "", "nothing to answer: no prompt and no conversation")
        # The read limit is the client's (generate_timeout_s); the interception answers
        # only when the engine has.
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) as http:
            r = await http.post(
                f"{endpoint.rstrip('/')}/chat/completions",
                json={"model": ctx.model, "messages": messages},
                headers={"Authorization": f"Bearer {secret}"},
            )
        if r.status_code != 200:
            return vf.ProgramResult(1, "", f"chat completion: HTTP {r.status_code}: {r.text}")
        return vf.ProgramResult(0, r.text, "")


def _wire(message: vf.Message) -> dict[str, Any]:
    """A conversation message as the engine takes it: text content, never None."""
    wire = message_to_wire(message)
    content = wire.get("content")
    if isinstance(content, list):  # text parts, joined (images are out of scope)
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    wire["content"] = content or ""
    return {k: v for k, v in wire.items() if k in ("role", "content", "name")}


__all__ = ["FlywheelChatHarness"]

"""The tool sandbox (ToolPool): real child processes with a memory limit and no network.

Each bad call costs only itself: the next call on the same pool answers. What
the sandbox keeps out is tests/integration/sandbox/test_escapes.py.
"""

from __future__ import annotations

from typing import Any

from services.sandbox import ToolPool
from services.tasks.tools import CALL
from tests.harness.sandbox import TESTS

PY = {"type": "python", "tag": "python", "description": ""}


def test_python_tool_is_confined_and_each_failure_costs_one_call(run_async: Any) -> None:
    async def body() -> list[Any]:
        async with ToolPool(size=1, timeout_s=2.0, memory_mb=256, sandbox=TESTS) as pool:
            calls = [
                "print(6 * 7)",
                "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
                "x = bytearray(512 * 1024 * 1024)",
                "while True: pass",
                "import os\nos._exit(3)",
                "1 / 0",
                "sum(range(10))",
            ]
            return [await pool.run(CALL, PY, code) for code in calls]

    out = run_async(body(), timeout_s=60)
    assert (out[0].text, out[0].error) == ("42\n", None)
    assert out[1].error == "raised" and "Error" in out[1].text  # refused, or no route
    assert out[2].error == "raised" and "MemoryError" in out[2].text
    assert out[3].error == "timeout" and "timed out after 2.0s" in out[3].text
    assert out[4].error == "crashed" and "exited with status 3" in out[4].text
    assert out[5].error == "raised" and "ZeroDivisionError" in out[5].text
    assert (out[6].text, out[6].error) == ("45", None)  # the pool still answers

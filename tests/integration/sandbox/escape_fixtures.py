"""A custom reward that runs the completion as code: the escape battery's attacker as a
reward function (tests/integration/sandbox/test_escapes.py), imported by path in the
verifier sandbox.

What the code printed comes back as reward parts: `leaked` (1 when `answer`,
the test's secret, appears in it) and every `name=<integer>` it printed.
"""

from __future__ import annotations

import re

from services.tasks.tools import run_python


def run_code(completion: str, answer: str | None) -> dict:
    try:
        out = run_python(completion)
    except Exception as e:  # noqa: BLE001 -- the refusal is the outcome the test reads
        out = f"raised {type(e).__name__}: {e}"
    parts = {k: float(v) for k, v in re.findall(r"(\w+)=(-?\d+)", out)}
    parts["leaked"] = float(bool(answer) and answer in out)
    parts["raised"] = float(out.startswith("raised "))
    return {"reward": 0.0, "parts": parts}


def environment(name: str) -> str:
    """A function tool: the value of one environment variable, and how many there are."""
    import os

    return f"{name}={os.environ.get(name)} count={len(os.environ)}"


def scored_code(completion: str, answer: str | None) -> dict:
    """A reward that runs the completion as code: its reward is the `score=<n>` it
    printed, every other `name=<n>` a part (the siblings case of the escape battery)."""
    try:
        out = run_python(completion)
    except Exception as e:  # noqa: BLE001 -- the refusal is the outcome the test reads
        out = f"raised {type(e).__name__}: {e}"
    parts = {k: float(v) for k, v in re.findall(r"(\w+)=(-?\d+)", out)}
    return {"reward": parts.pop("score", 0.0), "parts": parts}


def secret_tool(name: str) -> str:
    """A function tool that declares a secret in its `env`: it may read it, no one else."""
    import os

    return f"{name}={os.environ.get(name, '')}"

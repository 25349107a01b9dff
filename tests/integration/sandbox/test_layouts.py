"""Wherever the checkout lives: a reward and a tool run from a copy of Flywheel's packages
and the user's module under /tmp, and under a 0700 home directory with spaces in its
path, in bubblewrap and as plain processes (`insecure-allow`).

The plain child of a root service runs its calls as a uid of its own, which
cannot read a checkout in root's 0700 home; it reaches the code it runs
through directory fds opened before the switch (zygote.py), and nothing's
permissions are widened: the directory stays 0700 and the test checks it.
Each layout runs in a service process of its own (a subprocess that imports
`services` from the copy, not from this checkout).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.sandbox import require_sandbox

REPO = Path(__file__).resolve().parents[3]
USER = "fw_layout_user"
LAYOUTS = {"under-tmp": "fw", "0700-home-with-spaces": "home 0700/my check out"}

SERVICE = """
import asyncio, json, sys
root, mode = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import services
assert services.__file__.startswith(root + "/"), services.__file__
from services.sandbox import jail
if mode == "plain":
    jail.probe = lambda: "plain processes for this test"
from services.tasks import rewards as R
from services.tasks.episode_spec import FunctionTool
from services.sandbox.jail import Sandbox
from services.tasks.registry import as_fields
from services.tasks.rewards import CustomReward
from services.sandbox import ToolPool, VerifierPool
from services.tasks.tools import CALL

box = Sandbox(modules=("fw_layout_user",), required_by=() if mode == "plain" else ("test",))
parts = [as_fields(CustomReward(fn="fw_layout_user:reward"))]
tool = FunctionTool.model_validate({
    "type": "function", "tag": "shout", "fn": "fw_layout_user:tool",
    "parameters": {"text": {"type": "string"}},
}).model_dump(mode="json")
PY = {"type": "python", "tag": "python", "description": ""}
LAZY = "import sys\\nwas = 'services.tasks.taskset' in sys.modules\\n"
LAZY += "import services.tasks.taskset as m\\nprint(was, m.__name__)"

async def main():
    async with VerifierPool(1, 30.0, sandbox=box) as pool, \\
            ToolPool(1, 30.0, tools=[tool, PY], sandbox=box) as tools:
        r = await pool.call(R.SCORE, parts, "LOUD", None, {})
        t = await tools.run(CALL, tool, '{"text": "hi"}')
        lazy = await tools.run(CALL, PY, LAZY)
        print(json.dumps({
            "confined": [pool.confined, tools.confined], "reward": r.reward, "error": r.error,
            "tool": t.text, "tool_error": t.error, "lazy": lazy.text, "lazy_error": lazy.error,
        }))

asyncio.run(main())
"""


def checkout(base: Path, layout: str) -> Path:
    """A copy of Flywheel's packages and the user's reward/tool package at `layout` below
    `base`; the first directory of `layout` made 0700 if its name says so."""
    root = base / layout
    root.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__")
    for package in ("services", "proto"):
        shutil.copytree(REPO / package, root / package, ignore=skip)
    user = root / USER
    user.mkdir()
    (user / "__init__.py").write_text(
        "def reward(completion, answer):\n"
        "    from fw_layout_user import helper  # imported during the call\n"
        "    return helper.loud(completion)\n\n\n"
        "def tool(text):\n"
        "    from fw_layout_user import helper\n"
        "    return helper.shout(text)\n"
    )
    (user / "helper.py").write_text(
        "def loud(c):\n    return float(c.isupper())\n\n\n"
        "def shout(t):\n    return t.upper() + '!'\n"
    )
    top = base / Path(layout).parts[0]
    if "0700" in top.name:
        top.chmod(0o700)
    return root


@pytest.mark.parametrize("mode", ["bwrap", "plain"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_reward_and_a_tool_run_wherever_the_checkout_lives(
    tmp_path: Path, layout: str, mode: str
) -> None:
    if mode == "bwrap":
        require_sandbox()
    root = checkout(tmp_path, LAYOUTS[layout])
    assert str(root).startswith("/tmp/"), root
    out = subprocess.run(
        [sys.executable, "-c", SERVICE, str(root), mode],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["confined"] == [mode == "bwrap"] * 2, got
    assert (got["reward"], got["error"]) == (1.0, None), got
    assert (got["tool"], got["tool_error"]) == ("HI!", None), got
    assert (got["lazy"], got["lazy_error"]) == ("False services.tasks.taskset\n", None), got
    top = tmp_path / Path(LAYOUTS[layout]).parts[0]
    if "0700" in top.name:  # still closed to everyone else
        assert stat.S_IMODE(top.stat().st_mode) == 0o700

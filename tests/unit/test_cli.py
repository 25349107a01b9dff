"""`flywheel --help` lists the commands and imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys

from services.cli import COMMANDS

HEAVY = {"torch", "transformers", "nats", "aiohttp", "numpy", "pydantic"}

PROBE = f"""
import sys
from services.cli import main
main(["--help"])
print("LOADED", sorted({{m.split(".")[0] for m in sys.modules}} & {HEAVY!r}))
"""


def test_help_lists_commands_and_imports_nothing_heavy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    for name in COMMANDS:
        assert f"  {name} " in out
    assert out.strip().endswith("LOADED []")


def test_unknown_command_exits_2() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "services", "no-such-command"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "unknown command 'no-such-command'" in r.stderr

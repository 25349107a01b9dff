"""`flywheel --help` lists the commands and imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_a_reward_beside_the_run_file_imports_as_the_services_import_it(tmp_path: Path) -> None:
    """`flywheel` (a console script) puts the working directory on sys.path as
    `python -m services.<name>` does for the services `flywheel up` starts: a user's
    `reward = "my_rewards:score"` resolves in `flywheel eval` too."""
    (tmp_path / "my_rewards.py").write_text("def score(c, a):\n    return float(c == a)\n")
    code = (
        "import sys\n"
        "from services.sandbox import resolve\n"
        "{before}"
        "print(resolve('my_rewards:score')('b', 'b'))\n"
    )
    cli = "from services.cli import _import_from_cwd\n_import_from_cwd()\n"
    run = [sys.executable, "-I", "-c"]  # -I: no working directory on sys.path, as a script
    with_cli = subprocess.run([*run, code.format(before=cli)], cwd=tmp_path, capture_output=True)
    assert with_cli.stdout.decode().strip() == "1.0", with_cli.stderr.decode()
    without = subprocess.run([*run, code.format(before="")], cwd=tmp_path, capture_output=True)
    assert without.returncode != 0 and b"my_rewards" in without.stderr

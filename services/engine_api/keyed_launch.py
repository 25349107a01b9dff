"""`python -m services.engine_api.keyed_launch MODULE ARGS...`: run MODULE with its API key
taken from the environment, not from the command line.

SGLang reads its API key only from `--api-key KEY`, and a command line is
visible to every user of the host (`ps`, /proc/<pid>/cmdline). So `flywheel
up` starts SGLang through this: the key comes from `FLYWHEEL_ENGINE_API_KEY`
(the environment, readable only by the process's owner) or the file named by
`FLYWHEEL_ENGINE_API_KEY_FILE` (a mounted Secret), is added to `sys.argv`
inside this process, and MODULE runs here as `__main__` (runpy). The process's
own command line never holds it; SGLang's workers get their arguments by
pickle, not argv.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ENV = "FLYWHEEL_ENGINE_API_KEY"
ENV_FILE = "FLYWHEEL_ENGINE_API_KEY_FILE"


def api_key(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The key from the environment, or from the file it names; None if neither is set."""
    if env.get(ENV):
        return env[ENV]
    if env.get(ENV_FILE):
        key = Path(env[ENV_FILE]).read_text().strip()
        if not key:
            raise SystemExit(f"{ENV_FILE}={env[ENV_FILE]} is empty")
        return key
    return None


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m services.engine_api.keyed_launch MODULE [ARGS...]")
    module, args = argv[0], argv[1:]
    key = api_key()
    if "--api-key" in args:
        raise SystemExit("keyed_launch: the key comes from the environment, not --api-key")
    os.environ.pop(ENV, None)  # not inherited by what the module starts
    sys.argv = [module, *args, *(("--api-key", key) if key else ())]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])

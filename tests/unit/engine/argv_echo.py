"""Prints what it was given (sys.argv) and its process's real command line, as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

print(json.dumps({
    "argv": sys.argv[1:],
    "cmdline": Path("/proc/self/cmdline").read_bytes().decode().split("\0"),
    "env_key": os.environ.get("FLYWHEEL_ENGINE_API_KEY"),
}))  # fmt: skip

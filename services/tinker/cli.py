"""`flywheel tinker --model DIR` (and `python -m services.tinker`): the Tinker API server.

A handful of flags for the common overrides; everything else from the run file's
`[tinker]` table or FLYWHEEL_TINKER_* variables (TinkerSettings). Nothing heavy is
imported before the arguments parse, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from services.runtime.settings import load_settings
from services.tinker.settings import TinkerSettings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel tinker",
        description="Serve the Tinker training API (sessions, LoRA forward_backward / "
        "optim_step, sampling) on one base model: point the tinker SDK's base_url here.",
    )
    p.add_argument("-c", "--config", help="TOML run file ([tinker] table)")
    p.add_argument("--model", help="Hugging Face model directory (or a hub id in the local cache)")
    p.add_argument("--model-name", help="the base_model name clients pass (default: dir name)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    p.add_argument("--print-config", action="store_true", help="print resolved settings, exit")
    return p


def settings_from(args: argparse.Namespace) -> TinkerSettings:
    overrides: dict[str, Any] = {
        key: value
        for key, value in {
            "model": args.model,
            "model_name": args.model_name,
            "host": args.host,
            "port": args.port,
        }.items()
        if value is not None
    }
    return load_settings(TinkerSettings, args.config, **overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from services.models.resolve import model_settings

    settings = model_settings(lambda: settings_from(args), print_config=args.print_config,
                              section="tinker")  # fmt: skip
    if isinstance(settings, int):
        return settings
    from services.tinker.wire import sdk_missing

    if (why := sdk_missing()) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from services.runtime.lifecycle import install_signal_handlers, setup_logging
    from services.tinker.app import serve

    setup_logging("tinker", settings.log_level)

    async def amain() -> None:
        stop = asyncio.Event()
        remove = install_signal_handlers(asyncio.get_running_loop(), stop)
        try:
            await serve(settings, stop)
        finally:
            remove()

    from services.runtime.errors import FlywheelError
    from services.tinker.journal import JournalCorrupt

    try:
        asyncio.run(amain())
    except (FlywheelError, JournalCorrupt) as e:  # NATS unreachable, the journal unreadable
        print(f"flywheel tinker: {e}", file=sys.stderr)
        return 2
    return 0

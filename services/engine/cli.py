"""`python -m services.engine --model DIR [--host H] [--port N]` (and `flywheel engine`).

A handful of flags for the common overrides; everything else comes from the
run file's `[engine]` table or FLYWHEEL_ENGINE_* variables (EngineSettings).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from services.engine.settings import EngineSettings
from services.runtime.errors import ConfigError
from services.runtime.settings import load_settings, render


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.engine",
        description="Flywheel's CPU engine server (SGLang HTTP API subset).",
    )
    p.add_argument("-c", "--config", help="TOML run file ([engine] table)")
    p.add_argument("--model", help="Hugging Face model directory")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 30000; 0 = any free port)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on admin endpoints")
    p.add_argument("--weight-version", help="initial weight version (default 'default')")
    # SGLang's four LoRA flags, same names ([engine] enable_lora, ... in the run file).
    p.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank a load accepts")
    p.add_argument("--lora-target-modules", nargs="+", help="layers adapters may target")
    p.add_argument("--max-loras-per-batch", type=int, help="distinct adapters per batch (8)")
    p.add_argument("--print-config", action="store_true", help="print resolved settings, exit")
    return p


def settings_from(args: argparse.Namespace) -> EngineSettings:
    overrides: dict[str, Any] = {
        key: value
        for key, value in {
            "model": args.model,
            "host": args.host,
            "port": args.port,
            "api_key": args.api_key,
            "weight_version": args.weight_version,
            "enable_lora": args.enable_lora,
            "max_lora_rank": args.max_lora_rank,
            "lora_target_modules": args.lora_target_modules,
            "max_loras_per_batch": args.max_loras_per_batch,
        }.items()
        if value is not None
    }
    return load_settings(EngineSettings, args.config, **overrides)


async def _amain(settings: EngineSettings) -> None:
    from services.engine.app import serve
    from services.runtime.lifecycle import install_signal_handlers

    stop = asyncio.Event()
    remove = install_signal_handlers(asyncio.get_running_loop(), stop)
    try:
        await serve(settings, stop)
    finally:
        remove()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(render(settings))
        return 0
    if settings.model is None:
        print("error: no model directory (--model or [engine] model)", file=sys.stderr)
        return 2
    from services.models.resolve import resolve_model

    try:  # a hub id becomes its snapshot in the local cache
        settings = settings.model_copy(
            update={"model": resolve_model(settings.model, key="[engine] model")}
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from services.runtime.lifecycle import setup_logging

    setup_logging("engine", settings.log_level)
    asyncio.run(_amain(settings))
    return 0

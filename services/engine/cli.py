"""`python -m services.engine --model DIR [--host H] [--port N]` (and `flywheel engine`).

A handful of flags for the common overrides; everything else comes from the
run file's `[engine]` table or FLYWHEEL_ENGINE_* variables (EngineSettings).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

from services.engine.settings import EngineSettings
from services.runtime.errors import ConfigError
from services.runtime.settings import load_settings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.engine",
        description="Flywheel's CPU engine server (SGLang HTTP API subset).",
    )
    p.add_argument("-c", "--config", help="TOML run file ([engine] table)")
    p.add_argument("--model", help="Hugging Face model directory")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 30000; 0 = any free port)")
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on admin endpoints (SGLang's flag; visible "
        "in ps: prefer FLYWHEEL_ENGINE_API_KEY or --api-key-file)",
    )
    p.add_argument("--api-key-file", help="read the API key from this file (a mounted Secret)")
    p.add_argument("--weight-version", help="initial weight version (default 'default')")
    # SGLang's four LoRA flags, same names ([engine] enable_lora, ... in the run file).
    p.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank a load accepts")
    p.add_argument("--lora-target-modules", nargs="+", help="layers adapters may target")
    p.add_argument("--max-loras-per-batch", type=int, help="distinct adapters per batch (8)")
    p.add_argument("--print-config", action="store_true", help="print resolved settings, exit")
    return p


def settings_from(args: argparse.Namespace) -> EngineSettings:
    if args.api_key_file:
        from pathlib import Path

        try:
            args.api_key = Path(args.api_key_file).read_text().strip() or None
        except OSError as e:
            raise ConfigError(f"--api-key-file: {e}") from e
        if args.api_key is None:
            raise ConfigError(f"--api-key-file {args.api_key_file} is empty")
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
    from services.models.resolve import model_settings

    settings = model_settings(lambda: settings_from(args), print_config=args.print_config,
                              section="engine")  # fmt: skip
    if isinstance(settings, int):
        return settings
    from services.runtime.lifecycle import setup_logging

    setup_logging("engine", settings.log_level)
    asyncio.run(_amain(settings))
    return 0

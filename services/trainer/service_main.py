"""Entry point of the trainer service: every rank loads the model; rank 0 runs NATS."""

from __future__ import annotations

import asyncio
import sys

from services.common.errors import ConfigError
from services.common.service_main import parse_args
from services.common.settings import load_settings, render
from services.trainer.service_settings import TrainerSettings


def main(argv: list[str] | None = None) -> int:
    args = parse_args("trainer", argv)
    try:
        settings = load_settings(TrainerSettings, args.config)
    except ConfigError as e:
        print(f"flywheel trainer: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(render(settings))
        return 0
    from services.common.lifecycle import run_service, setup_logging
    from services.trainer.distributed import init_distributed, shutdown
    from services.trainer.service import follower_loop, load_trainer, make_body

    setup_logging("trainer", settings.log_level)
    info = init_distributed()
    try:
        trainer, seq = load_trainer(settings, info)
        if info.is_main:
            asyncio.run(run_service("trainer", settings, make_body(trainer, seq)))
        else:
            follower_loop(trainer, settings)
    finally:
        shutdown(info)
    return 0

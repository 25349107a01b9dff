"""Entry point of the trainer service: every rank loads the model; rank 0 runs NATS."""

from __future__ import annotations

import asyncio

from services.common.service_main import parse_args, settings_or_exit
from services.trainer.service_settings import TrainerSettings


def main(argv: list[str] | None = None) -> int:
    args = parse_args("trainer", argv)
    settings = settings_or_exit("trainer", TrainerSettings, args.config, args.print_config)
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

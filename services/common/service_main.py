"""The `main()` every service shares: `-c run.toml`, `--print-config`, run until stopped.

    python -m services.buffer -c run.toml [--print-config]

Settings come from the run file's section plus `FLYWHEEL_<SECTION>_…`
environment overrides; a bad value exits with status 2 and a message that
names the field, before anything connects.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.common.errors import ConfigError
from services.common.settings import ServiceSettings, load_settings, render

if TYPE_CHECKING:
    from services.common.lifecycle import Body


def parse_args(service: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"flywheel {service}", description=f"Run the {service}.")
    p.add_argument("-c", "--config", help=f"TOML run file (its [{service}] table and shared keys)")
    p.add_argument("--print-config", action="store_true", help="print resolved settings and exit")
    return p.parse_args(argv)


def service_main(
    service: str,
    settings_cls: type[ServiceSettings],
    body: Callable[[], Body],
    argv: list[str] | None = None,
) -> int:
    """Load settings, then run `body()` (a lazily imported service body) under run_service."""
    args = parse_args(service, argv)
    try:
        settings = load_settings(settings_cls, args.config)
    except ConfigError as e:
        print(f"flywheel {service}: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(render(settings))
        return 0
    from services.common.lifecycle import run_service, setup_logging

    setup_logging(service, settings.log_level)
    try:
        asyncio.run(run_service(service, settings, body()))
    except ConfigError as e:
        print(f"flywheel {service}: {e}", file=sys.stderr)
        return 2
    return 0

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
from typing import TYPE_CHECKING, TypeVar

from services.runtime.errors import (
    EXIT_CONFIG,
    EXIT_DONE,
    EXIT_HALTED,
    EXIT_MISSING,
    ConfigError,
    JetStreamMissing,
    RunDone,
    RunHalted,
)
from services.runtime.settings import ServiceSettings, load_settings, render

S = TypeVar("S", bound=ServiceSettings)

if TYPE_CHECKING:
    from services.runtime.lifecycle import Body


def parse_args(service: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"flywheel {service}", description=f"Run the {service}.")
    p.add_argument("-c", "--config", help=f"TOML run file (its [{service}] table and shared keys)")
    p.add_argument("--print-config", action="store_true", help="print resolved settings and exit")
    return p.parse_args(argv)


def settings_or_exit(
    command: str, cls: type[S], config: str | None, print_config: bool, *, attach: bool = False
) -> S:
    """The resolved settings; or exit 2 naming the bad field, or 0 after --print-config.

    `attach`: a command that joins a run `flywheel up` runs here takes that
    run's NATS URL from its run directory (services/runtime/local_run.py).
    """
    try:
        overrides = {}
        if attach and config and not print_config:
            from services.runtime.local_run import attach as attach_run

            overrides = attach_run(config, cls.section)
        settings = load_settings(cls, config, **overrides)
    except ConfigError as e:  # may quote a value: a URL with a password in it
        from services.runtime.redact import redact

        print(f"flywheel {command}: {redact(str(e))}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from e
    if print_config:
        print(render(settings))
        raise SystemExit(0)
    return settings


def service_main(
    service: str,
    settings_cls: type[ServiceSettings],
    body: Callable[[], Body],
    argv: list[str] | None = None,
    *,
    attach: bool = False,
) -> int:
    """Load settings, then run `body()` (a lazily imported service body) under run_service."""
    args = parse_args(service, argv)
    settings = settings_or_exit(
        service, settings_cls, args.config, args.print_config, attach=attach
    )
    from services.runtime.lifecycle import run_service, setup_logging

    setup_logging(service, settings.log_level)
    return run_or_exit(service, lambda: asyncio.run(run_service(service, settings, body())))


FINAL_ERRORS: tuple[tuple[type[Exception], int], ...] = (
    (ConfigError, EXIT_CONFIG),
    (RunHalted, EXIT_HALTED),
    (JetStreamMissing, EXIT_MISSING),
    (RunDone, EXIT_DONE),
)
"""Errors a restart cannot fix (and the run's work done), and the exit status of each."""


def run_or_exit(service: str, run: Callable[[], object]) -> int:
    """`run()`; an error a restart cannot fix is one line on stderr and its exit status."""
    try:
        run()
    except tuple(e for e, _ in FINAL_ERRORS) as e:
        from services.runtime.redact import redact

        print(f"flywheel {service}: {redact(str(e))}", file=sys.stderr)
        return next(code for cls, code in FINAL_ERRORS if isinstance(e, cls))
    return 0

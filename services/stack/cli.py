"""`flywheel up -c run.toml`: the whole run as supervised local processes.

Starts the embedded nats-server (unless the run file points at an external
one), then engines, rollout workers, sync, trainer and buffer in readiness
order (`[stack] services` picks a subset, as Kubernetes pods would), shows
a status line every few seconds, and stops everything on Ctrl-C, on
`--steps N` reached, or when a service dies and may not be restarted.
`--dry-run` prints every process's GPUs, command and environment instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from services.common.ports import free_port
from services.common.service_main import settings_or_exit
from services.stack.settings import StackSettings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flywheel up", description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", required=True, help="TOML run file")
    p.add_argument("--steps", type=int, help="stop once the trainer has done this many steps")
    p.add_argument("--quiet", action="store_true", help="service output to log files only")
    p.add_argument("--print-config", action="store_true", help="print [stack] settings and exit")
    p.add_argument(
        "--dry-run", action="store_true",
        help="print each process's GPUs, command and environment; start nothing",
    )  # fmt: skip
    return p


async def up(
    s: StackSettings,
    config: Path,
    *,
    steps: int | None,
    quiet: bool,
    target_accuracy: float | None = None,
    max_seconds: float | None = None,
) -> int:
    """Run the stack until Ctrl-C, `steps` trained, `target_accuracy` reached
    (the trainer's held-out evaluation), `max_seconds` passed, or a failure."""
    from services.common import local_run
    from services.common.nats_cluster import embedded_nats
    from services.stack.plan import plan
    from services.stack.status import render_line, scrape, summarise
    from services.stack.supervisor import StackError, Supervisor

    run_dir = s.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    nats = None
    url = s.nats.url
    if s.embedded_nats:
        nats = embedded_nats(s.nats_cluster, port=s.nats_port, store_dir=run_dir / "nats").start()
        url = nats.url
        # `flywheel status -c` and workers added by hand find this NATS here
        local_run.record(run_dir, url, s.model.resolve())
        what = "nats-server" if s.nats_cluster == 1 else f"NATS cluster of {s.nats_cluster}"
        print(f"flywheel up: embedded {what} at {url} (store {run_dir / 'nats'})")
    specs = plan(s, config.resolve(), url, free_port)
    sup = Supervisor(
        specs, run_dir / "logs", on_failure=s.on_failure, max_restarts=s.max_restarts,
        ready_timeout_s=s.ready_timeout_s, stop_grace_s=s.stop_grace_s,
        console=None if quiet else sys.stdout, pids_file=run_dir / "pids.json",
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    status_file = run_dir / "status.log"
    try:
        await sup.start_all()
        print(f"flywheel up: all services ready; logs in {run_dir / 'logs'}")
        watcher = asyncio.create_task(sup.watch(stop))
        urls = {p.spec.name: p.spec.metrics_url for p in sup.procs if p.spec.metrics_url}
        before = None
        deadline = time.monotonic() + max_seconds if max_seconds else None
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), s.status_interval_s)
            now = summarise(await scrape(urls))
            line = render_line(now, before)
            before = now
            print(f"flywheel up: {line}", flush=True)
            with status_file.open("a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            if steps is not None and now.step is not None and now.step >= steps:
                print(f"flywheel up: reached {steps} steps; stopping")
                stop.set()
            elif target_accuracy is not None and (now.accuracy or 0.0) >= target_accuracy:
                print(f"flywheel up: held-out accuracy {now.accuracy:.3f} reached; stopping")
                stop.set()
            elif deadline is not None and time.monotonic() > deadline:
                print(f"flywheel up: {max_seconds:.0f}s passed; stopping")
                stop.set()
        await watcher
    except StackError as e:
        print(f"flywheel up: {e}", file=sys.stderr)
        sup.failed = str(e)
    finally:
        await sup.stop_all()
        if nats is not None:
            local_run.forget(run_dir)
            nats.close()
    return 1 if sup.failed else 0


SETTINGS = {
    "buffer": "services.buffer.settings:BufferSettings",
    "rollout": "services.rollout.settings:RolloutSettings",
    "trainer": "services.trainer.service_settings:TrainerSettings",
    "sync": "services.sync.settings:SyncSettings",
    "engine": "services.rollout.engine.settings:EngineSettings",
}


def preflight(s: StackSettings, config: str, *, data: bool = True) -> int:
    """Every service's settings and (with `data`) the task's files and packages, checked
    before anything starts: one report of what is wrong, not a service dying after the
    engines loaded."""
    import importlib

    from services.common.errors import EXIT_CONFIG, ConfigError
    from services.common.settings import load_settings

    errors = []
    for kind in s.services:
        module, _, name = SETTINGS[kind].partition(":")
        try:
            load_settings(getattr(importlib.import_module(module), name), config)
        except ConfigError as e:
            errors.append(str(e).removeprefix("invalid settings:\n").strip())
    if not errors and {"buffer", "trainer", "rollout"} & set(s.services):
        try:
            s.task_set().check(data=data)
        except ConfigError as e:
            errors.append(str(e))
    for line in dict.fromkeys(errors):  # one service's error names shared keys ([task]) too
        print(f"flywheel up: {line}", file=sys.stderr)
    return EXIT_CONFIG if errors else 0


def dry_run(s: StackSettings, config: Path) -> str:
    """What `up` would start (ports are examples: `up` picks free ones again)."""
    from services.stack.plan import describe, plan

    nats = f"nats://127.0.0.1:{s.nats_port or '<free port>'}" if s.embedded_nats else s.nats.url
    head = f"nats: {'embedded nats-server at ' if s.embedded_nats else ''}{nats}"
    return head + "\n" + describe(plan(s, config.resolve(), nats, free_port))


def up_main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    settings = settings_or_exit("up", StackSettings, args.config, args.print_config)
    # A dry run shows another machine's plan: its data paths need not exist here.
    if code := preflight(settings, args.config, data=not args.dry_run):
        return code
    if args.dry_run:
        print(dry_run(settings, Path(args.config)))
        return 0
    return asyncio.run(up(settings, Path(args.config), steps=args.steps, quiet=args.quiet))

"""`flywheel up -c run.toml`: the whole run as supervised local processes.

Starts the embedded nats-server (unless the run file points at an external
one), then engines, rollout workers, sync, trainer and buffer in readiness
order (`[stack] services` picks a subset, as Kubernetes pods would), shows
a status line every few seconds and, of the services' output, only what the
user must act on (warnings, errors: their INFO lines go to `<run_dir>/logs/`,
`--verbose` shows them too), and stops everything on Ctrl-C, on
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.runtime.service_main import settings_or_exit
from services.stack.localdev.ports import free_port
from services.stack.settings import StackSettings

if TYPE_CHECKING:
    from services.stack.status import Status
    from services.stack.supervisor import Supervisor


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flywheel up", description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", required=True, help="TOML run file")
    p.add_argument("--steps", type=int, help="stop once the trainer has done this many steps")
    add_console_flags(p)
    p.add_argument("--print-config", action="store_true", help="print [stack] settings and exit")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="start without the pre-flight check of the base model ([stack] check = false)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print each process's GPUs, command and environment; start nothing",
    )
    return p


def add_console_flags(p: argparse.ArgumentParser) -> None:
    """`--verbose` / `--quiet`: how much of the services' output the console shows (all of it
    goes to `<run_dir>/logs/<service>.log` either way)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--verbose",
        action="store_true",
        help="every line of every service on the console (default: warnings and errors only)",
    )
    g.add_argument("--quiet", action="store_true", help="service output to log files only")


def trainer_max_steps(config: Path) -> int | None:
    """The run file's `[trainer] max_steps`: the same end as `--steps` (a trainer that
    stops by itself is not a crash for the supervisor to restart)."""
    import tomllib

    value = tomllib.loads(config.read_text()).get("trainer", {}).get("max_steps")
    return value if isinstance(value, int) else None


async def up(
    s: StackSettings,
    config: Path,
    *,
    steps: int | None,
    quiet: bool,
    verbose: bool = False,
    target_accuracy: float | None = None,
    max_seconds: float | None = None,
) -> int:
    """Run the stack until Ctrl-C, `steps` trained, `target_accuracy` reached
    (the trainer's held-out evaluation), `max_seconds` passed, or a failure."""
    from services.runtime import local_run
    from services.stack.plan import plan
    from services.stack.supervisor import StackError, Supervisor

    run_dir = s.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = steps if steps is not None else trainer_max_steps(config)
    # A Tinker-only run (engines and the Tinker server) uses no NATS.
    nats, url = start_nats(s, run_dir) if NATS_SERVICES & set(s.services) else (None, s.nats.url)
    # A trainer started here stops itself after `steps` (exactly that many: the status line
    # sees a step seconds late, while batches in flight go on training) and its exit ends the
    # run; only a trainer running elsewhere is watched for it through the status line.
    local_trainer = steps is not None and "trainer" in s.services
    sup = Supervisor(
        plan(s, config.resolve(), url, free_port, max_steps=steps if local_trainer else None),
        run_dir / "logs",
        on_failure=s.on_failure,
        max_restarts=s.max_restarts,
        ready_timeout_s=s.ready_timeout_s,
        stop_grace_s=s.stop_grace_s,
        console=None if quiet else sys.stdout,
        verbose=verbose,
        pids_file=run_dir / "pids.json",
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    goal = Goal(None if local_trainer else steps, target_accuracy, max_seconds)
    try:
        if not await started_unless(sup.start_all(), stop):
            print("flywheel up: stopped while starting; stopping what has started", flush=True)
            return 130
        more = "" if verbose or quiet else " (--verbose shows them here)"
        print(f"flywheel up: all services ready; their logs in {run_dir / 'logs'}{more}")
        for p in sup.procs:
            if p.spec.kind == "tinker":
                url = (p.spec.ready_url or "").removesuffix("/api/v1/healthz")
                print(f"flywheel up: Tinker API at {url} (the SDK's base_url)", flush=True)
        watcher = asyncio.create_task(sup.watch(stop))
        await show_status(s, sup, run_dir / "status.log", stop, goal)
        await watcher
        if sup.finished is not None:
            after = f" ({steps} steps)" if sup.finished.endswith("finished") else ""
            print(f"flywheel up: {sup.finished}{after}; stopping", flush=True)
    except StackError as e:
        print(f"flywheel up: {e}", file=sys.stderr)
        sup.failed = str(e)
    finally:
        await sup.stop_all()
        if nats is not None:
            local_run.forget(run_dir)
            nats.close()
    return 1 if sup.failed else 0


async def started_unless(starting: Any, stop: asyncio.Event) -> bool:
    """Await `starting` (every service started and ready) unless `stop` is set first (Ctrl-C,
    SIGTERM): then cancel it and return False. Engines of a real model take minutes to load,
    and a stop asked for meanwhile must not wait for them to be ready."""
    start = asyncio.ensure_future(starting)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if start.done():
        start.result()  # its StackError, if one
        return True
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start
    return False


def start_nats(s: StackSettings, run_dir: Path) -> tuple[Any, str]:
    """The embedded NATS (one server or a cluster) and its URL; none with an external one."""
    from services.runtime import local_run
    from services.stack.localdev.nats_cluster import embedded_nats

    if not s.embedded_nats:
        return None, s.nats.url
    nats = embedded_nats(s.nats_cluster, port=s.nats_port, store_dir=run_dir / "nats").start()
    # `flywheel status -c` and workers added by hand find this NATS here
    local_run.record(run_dir, nats.url, s.model.resolve())
    what = "nats-server" if s.nats_cluster == 1 else f"NATS cluster of {s.nats_cluster}"
    print(f"flywheel up: embedded {what} at {nats.url} (store {run_dir / 'nats'})")
    return nats, nats.url


@dataclass(frozen=True)
class Goal:
    """When `up` stops by itself: steps trained, validation accuracy, or wall time."""

    steps: int | None = None
    accuracy: float | None = None
    seconds: float | None = None

    def reached(self, now: Status, elapsed_s: float) -> str | None:
        """Why to stop, given the status `now`, or None to go on."""
        if self.steps is not None and now.step is not None and now.step >= self.steps:
            return f"reached {self.steps} steps"
        if self.accuracy is not None and (now.accuracy or 0.0) >= self.accuracy:
            return f"validation accuracy {now.accuracy:.3f} reached"
        if self.seconds and elapsed_s > self.seconds:
            return f"{self.seconds:.0f}s passed"
        return None


async def show_status(
    s: StackSettings, sup: Supervisor, status_file: Path, stop: asyncio.Event, goal: Goal
) -> None:
    """A status line every `status_interval_s` (console and status.log) until stop or goal."""
    from services.runtime.msgloop import pause
    from services.stack.status import RateWindow, render_line, scrape, summarise

    urls = {p.spec.name: p.spec.metrics_url for p in sup.procs if p.spec.metrics_url}
    window = RateWindow()  # samples/s over a window spanning steps, not 0.0 between them
    started = time.monotonic()
    while not stop.is_set():
        await pause(stop, s.status_interval_s)
        now = summarise(await scrape(urls))
        if urls:  # a Tinker-only run has no loop to report (no service serves metrics)
            line = render_line(now, window.start(now))
            print(f"flywheel up: {line}", flush=True)
            with status_file.open("a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        why = goal.reached(now, time.monotonic() - started)
        if why is not None:
            print(f"flywheel up: {why}; stopping")
            stop.set()


SETTINGS = {
    "buffer": "services.buffer.settings:BufferSettings",
    "rollout": "services.rollout.settings:RolloutSettings",
    "trainer": "services.trainer.settings:TrainerSettings",
    "sync": "services.sync.settings:SyncSettings",
    "engine": "services.engine.settings:EngineSettings",
    "tinker": "services.tinker.settings:TinkerSettings",
}
NATS_SERVICES = frozenset({"rollout", "sync", "trainer", "buffer"})  # engines and tinker: none


def settings_class(kind: str) -> Any:
    """A service's settings class, named in SETTINGS (the stack imports no service)."""
    import importlib

    module, _, name = SETTINGS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def preflight(s: StackSettings, config: str, *, data: bool = True) -> int:
    """Every service's settings and (with `data`) the task's files and packages, checked
    before anything starts: one report of what is wrong, not a service dying after the
    engines loaded."""
    from services.runtime.errors import EXIT_CONFIG, ConfigError
    from services.runtime.settings import load_settings

    errors = []
    loaded: dict[str, Any] = {}
    for kind in s.services:
        try:
            loaded[kind] = load_settings(settings_class(kind), config)
        except ConfigError as e:
            errors.append(str(e).removeprefix("invalid settings:\n").strip())
    if not errors:
        errors += lora_mismatches(loaded) + distill_mismatches(loaded) + tinker_mismatches(loaded)
    if not errors and {"buffer", "trainer", "rollout"} & set(s.services):
        try:
            s.task_set().check(data=data)
        except ConfigError as e:
            errors.append(str(e))
    if not errors and "rollout" in s.services and s.judged():
        if not s.judge.urls and not (s.judge.engines and "engine" in s.services):
            errors.append("[judge] engines = 0 and no urls: a task has a judge reward, and "
                          "nothing would answer it")  # fmt: skip
    if data:
        try:
            model = with_model(s).model
        except ConfigError as e:
            errors.append(str(e))
        else:
            errors += disk_shortfalls(loaded, Path(model))
    for line in dict.fromkeys(errors):  # one service's error names shared keys ([task]) too
        print(f"flywheel up: {line}", file=sys.stderr)
    return EXIT_CONFIG if errors else 0


def disk_shortfalls(loaded: dict[str, Any], model: Path) -> list[str]:
    """Errors where the trainer's disk cannot hold its first step's checkpoint and weights;
    a warning (printed here) where it cannot hold the steady state (services/stack/diskplan.py).
    """
    from services.stack.diskplan import plan_for, shortfalls

    trainer, sync = loaded.get("trainer"), loaded.get("sync")
    if trainer is None or trainer.lora is not None or trainer.replay:
        return []  # an adapter's checkpoints are small; a replay writes none of the run's
    if sync is None:  # not run here: its default, read through the settings table
        keep_last = settings_class("sync").model_fields["keep_last"].default
    else:
        keep_last = sync.keep_last
    plan = plan_for(model, trainer.keep_checkpoints, keep_last)
    if plan is None:
        return []
    errors, warnings = shortfalls(plan, trainer.checkpoint_dir, trainer.weights_root)
    for line in warnings:
        print(f"flywheel up: warning: {line}", file=sys.stderr)
    return errors


def lora_mismatches(loaded: dict[str, Any]) -> list[str]:
    """What keeps the services of a `[trainer.lora]` run from agreeing: with `[sync]
    lora_mode = "adapter"` the engines must serve adapters of that rank and those modules
    (`[engine]`, for the CPU engine and SGLang's flags alike) and the workers must name them
    (`[rollout] lora`); otherwise each service would start and the run fail at the first
    version (an engine refusing the load, or workers sampling the base forever)."""
    trainer, sync = loaded.get("trainer"), loaded.get("sync")
    lora = getattr(trainer, "lora", None)
    if lora is None or sync is None or sync.lora_mode != "adapter":
        return []
    out = []
    engine, rollout = loaded.get("engine"), loaded.get("rollout")
    if engine is not None:
        targets = set(engine.lora_target_modules or [])
        missing = sorted(set(lora.modules) - targets) if "all" not in targets else []
        if not engine.enable_lora:
            out.append("[trainer.lora] with [sync] lora_mode = 'adapter' needs [engine] "
                       "enable_lora = true (and max_lora_rank, lora_target_modules)")  # fmt: skip
        elif (engine.max_lora_rank or 0) < lora.rank or missing:
            out.append(f"[engine] max_lora_rank = {engine.max_lora_rank} and "
                       f"lora_target_modules = {sorted(targets)} cannot serve [trainer.lora] "
                       f"rank {lora.rank} on {list(lora.modules)}")  # fmt: skip
    if rollout is not None and not rollout.lora:
        out.append("[trainer.lora] with [sync] lora_mode = 'adapter' needs [rollout] lora = "
                   "true: the workers would sample from the base model only")  # fmt: skip
    return out


def tinker_mismatches(loaded: dict[str, Any]) -> list[str]:
    """The Tinker server samples on the engines started beside it: they must serve LoRA
    adapters, or every save_weights_and_get_sampling_client would fail."""
    engine = loaded.get("engine")
    if "tinker" not in loaded or engine is None or engine.enable_lora:
        return []
    return ["[stack] services runs 'tinker' beside engines: they need [engine] enable_lora = "
            "true, max_lora_rank (the largest rank clients ask) and lora_target_modules = "
            "['all'] (configs/examples/tinker.toml)"]  # fmt: skip


def distill_mismatches(loaded: dict[str, Any]) -> list[str]:
    """`[trainer.distill]` trains on the teacher logprobs the workers' `[teacher]` adds: without
    one, every batch would stop the trainer."""
    trainer, rollout = loaded.get("trainer"), loaded.get("rollout")
    if getattr(trainer, "distill", None) is None or rollout is None or rollout.teacher:
        return []
    return ["[trainer.distill] needs a [teacher] table: no sample would carry teacher logprobs"]


def with_model(s: StackSettings) -> StackSettings:
    """`s` with `[stack] model` resolved to a directory (a hub id: its snapshot in the local
    Hugging Face cache), so every process is given the same directory; a ConfigError naming
    `[stack] model` in one line when there is none (services/models/resolve.py)."""
    from services.models.resolve import resolve_model

    if not {"engine", "rollout", "trainer", "tinker"} & set(s.services):
        return s
    update: dict[str, Any] = {"model": resolve_model(s.model, key="[stack] model")}
    t = s.teacher
    if t is not None and t.model is not None and t.engines and "engine" in s.services:
        # the teacher's engines load it here, and every sample records it
        update["teacher"] = t.model_copy(
            update={"model": resolve_model(t.model, key="[teacher] model")}
        )
    return s.model_copy(update=update)


def dry_run(s: StackSettings, config: Path) -> str:
    """What `up` would start (ports are examples: `up` picks free ones again)."""
    from services.stack.plan import describe, plan

    nats = f"nats://127.0.0.1:{s.nats_port or '<free port>'}" if s.embedded_nats else s.nats.url
    head = f"nats: {'embedded nats-server at ' if s.embedded_nats else ''}{nats}"
    if not NATS_SERVICES & set(s.services):
        head = "nats: none (no service started here uses it)"
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
    settings = with_model(settings)  # preflight has checked it resolves
    if settings.check and not args.no_check and NATS_SERVICES & set(settings.services):
        from services.stack.check import before_up

        before_up(settings, args.config)
    console = {"quiet": args.quiet, "verbose": args.verbose}
    return asyncio.run(up(settings, Path(args.config), steps=args.steps, **console))

"""The recorded run a replay reads: its settings, its directory and model, and its NATS.

Where the run's streams are, in this order: `--nats URL` as given; the
run file's own NATS (`[nats] url`, or `[stack] embedded_nats = false`:
Kubernetes, an external server); the nats-server of a `flywheel up` of
this run file still going (`<run_dir>/run.json`); otherwise the stopped
run's store (`<run_dir>/nats`), opened by a nats-server of our own for as
long as the replay reads (`Hooks.open_store`: the stack's embedded
server, handed in by services/cli.py because no service imports the stack).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.messages import PromptTask
from services.replay.settings import ReplaySettings
from services.runtime import local_run
from services.runtime.errors import ConfigError
from services.runtime.settings import load_settings, read_run_file, run_path

TrainerProcess = Callable[[Path, str], "tuple[tuple[str, ...], dict[str, str], tuple[int, ...]]"]
"""(run file, NATS URL) -> the trainer `flywheel up` would start: argv, environment, cores."""


@dataclass(frozen=True)
class Hooks:
    """What a replay needs of other services, handed in by services/cli.py (no service
    imports another): the stack's (services/stack/replaying.py) and the buffer's
    (services/buffer/replaying.py). None: that part of a replay is unavailable."""

    open_store: Callable[[Path], AbstractContextManager[str]] | None = None
    trainer_process: TrainerProcess | None = None
    task_finder: Callable[[Path], Callable[[int, int], PromptTask]] | None = None


@dataclass(frozen=True)
class RecordedRun:
    """A run file's recorded run: its settings and where `flywheel up` kept it."""

    config: Path
    settings: ReplaySettings
    doc: dict[str, Any]  # the run file as read
    run_dir: Path
    model: Path

    @property
    def run(self) -> str:
        return self.settings.run

    @property
    def out_dir(self) -> Path:
        return self.settings.out_dir or self.run_dir / "replay"

    def model_dir(self) -> Path:
        """The run's model directory, resolved as `flywheel up` resolves it (a hub id: its
        cached snapshot); a ModelNotFoundError naming `[stack] model` in one line if none."""
        from services.models.resolve import resolve_model

        return resolve_model(self.model, key="[stack] model")


def recorded_run(config: Path, **overrides: Any) -> RecordedRun:
    """The run of `config` (ConfigError naming a bad key); `overrides` to ReplaySettings."""
    doc = read_run_file(config)
    stack = doc.get("stack", {}) if isinstance(doc.get("stack"), dict) else {}
    # read as every command reads a run file's paths (services/runtime/settings.py, RunPath)
    run_dir = run_path(stack.get("run_dir", local_run.DEFAULT_RUN_DIR)).resolve()
    model = run_path(stack.get("model", f"{local_run.DEFAULT_RUN_DIR}/model"))
    settings = load_settings(ReplaySettings, config, **overrides)
    return RecordedRun(config.resolve(), settings, doc, run_dir, model)


@contextlib.contextmanager
def nats_url(rec: RecordedRun, given: str | None, hooks: Hooks) -> Iterator[str]:
    """The URL of the NATS that holds `rec`'s streams, while the replay reads (module doc)."""
    if given:
        yield given
        return
    if not local_run.leaves_nats_to_up(rec.doc, "replay"):
        yield rec.settings.nats.url
        return
    live = local_run.find(rec.run_dir)
    if live is not None:
        yield live.nats_url
        return
    if hooks.open_store is None:
        raise ConfigError(f"no NATS for run {rec.run!r}: give --nats URL")
    with hooks.open_store(rec.run_dir) as url:
        yield url


@contextlib.asynccontextmanager
async def connected(rec: RecordedRun, url: str) -> Any:
    """A JetStream context on `url` (the connection closed on the way out)."""
    from services.runtime.nats_conn import connect

    nc = await connect(rec.settings.nats.model_copy(update={"url": url}), "flywheel-replay")
    try:
        yield nc.jetstream()
    finally:
        quiet = logging.getLogger("services.runtime.nats_conn")
        level, quiet.level = quiet.level, logging.ERROR  # our own close is no "disconnected"
        try:
            await nc.close()
        finally:
            quiet.setLevel(level)

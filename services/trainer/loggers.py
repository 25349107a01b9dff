"""Where the trainer's metrics rows go: JSONL, TensorBoard, Weights & Biases.

    [trainer]
    loggers = ["jsonl", "tensorboard", "wandb"]

Every row the trainer service writes (one per step: the batch's reward and
lengths, the loss metrics, timings, eval accuracy) goes to each configured
logger, the same row to each. 'jsonl' appends it to `metrics_file` (the
file `flywheel status`, the demo plot and crash recovery read);
'tensorboard' writes each numeric field as a scalar at the row's step,
flushed per row so a crash loses nothing and TensorBoard shows it at once;
'wandb' logs it to a W&B run, offline by default (no network: `wandb sync`
uploads it later). TensorBoard and W&B are optional extras
(`pip install 'flywheel[tensorboard]'`, `'flywheel[wandb]'`); naming one
that is not installed fails at start-up, naming the extra.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal, Protocol

from services.runtime.errors import FlywheelError

LoggerName = Literal["jsonl", "tensorboard", "wandb"]
WandbMode = Literal["offline", "online"]
NOT_SCALARS = frozenset({"step", "time"})  # the axis and the wall clock, not series


class LoggerError(FlywheelError, RuntimeError):
    """A configured logger cannot run (its package is missing)."""


class MetricsLogger(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric fields (bools as 0/1), without the step and the wall clock."""
    out = {}
    for k, v in row.items():
        if k in NOT_SCALARS or not isinstance(v, int | float):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class JsonlLogger:
    """One JSON line per row, appended (the file is opened per row: a crash loses nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, row: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars `trainer/<field>` at the row's step, in TensorBoard event files under `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise LoggerError(
                "loggers includes 'tensorboard' but the tensorboard package is not installed: "
                "pip install 'flywheel[tensorboard]'"
            ) from e
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        step, wall = int(row.get("step", 0)), row.get("time")
        for k, v in scalars(row).items():
            self.writer.add_scalar(f"trainer/{k}", v, global_step=step, walltime=wall)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run (offline unless told otherwise) logging each row at its step."""

    def __init__(self, run: str, project: str, mode: WandbMode, root: Path, config: dict) -> None:
        try:
            import wandb
        except ImportError as e:
            raise LoggerError(
                "loggers includes 'wandb' but the wandb package is not installed: "
                "pip install 'flywheel[wandb]'"
            ) from e
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run, dir=str(root), mode=mode, config=config)

    def write(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=int(row.get("step", 0)))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before W&B's service has written the offline record
        # log (wandb 0.31: the file held only its 7-byte header right after it);
        # teardown waits for the service, so a finished trainer's rows are on disk.
        wandb.teardown()


class Loggers:
    """The configured loggers as one: a row goes to each, in order."""

    def __init__(self, loggers: list[MetricsLogger]) -> None:
        self.loggers = loggers

    def write(self, row: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.write(row)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def open_loggers(
    names: list[LoggerName],
    *,
    run: str,
    metrics_file: Path | None,
    log_dir: Path | None,
    wandb_project: str = "flywheel",
    wandb_mode: WandbMode = "offline",
    config: dict | None = None,
) -> Loggers:
    """The loggers `names` asks for. TensorBoard and W&B write under `log_dir`
    (default: beside `metrics_file`, else runs/logs): `<dir>/tensorboard/<run>/`
    and `<dir>/wandb/`. 'jsonl' without a metrics_file writes nothing."""
    root = log_dir or (metrics_file.parent if metrics_file else Path("runs/logs"))
    out: list[MetricsLogger] = []
    for name in dict.fromkeys(names):
        if name == "jsonl" and metrics_file is not None:
            out.append(JsonlLogger(metrics_file))
        elif name == "tensorboard":
            out.append(TensorBoardLogger(root / "tensorboard" / run))
        elif name == "wandb":
            out.append(WandbLogger(run, wandb_project, wandb_mode, root, config or {}))
    return Loggers(out)

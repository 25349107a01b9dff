"""Settings of the RL trainer service (`[trainer]` in the run file)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from services.common.settings import ServiceSettings
from services.common.weights import TransportKind
from services.trainer.config import ModelConfig, OptimConfig, TrainConfig
from services.trainer.core.config import LossConfig
from services.trainer.loggers import LoggerName, WandbMode


class TrainerSettings(ServiceSettings):
    section: ClassVar[str] = "trainer"
    needs_task: ClassVar[bool] = True

    model: Path = Field(Path("runs/demo/model"), description="Initial policy (HF directory).")
    weights_root: Path = Field(
        Path("runs/weights"), description="Published weights go to <root>/<run>/v000012/."
    )
    weights_transport: TransportKind = Field(
        "disk",
        description="How engines get weights: 'disk' announces the shared directory; 'nats' "
        "also sends it as chunks into JetStream (no shared storage needed).",
    )
    weights_upload_window: int = Field(
        16, ge=1, le=1024, description="NATS transport: chunk publishes in flight at once."
    )
    checkpoint_dir: Path = Field(Path("runs/checkpoints"), description="Trainer checkpoints.")
    publish_every: int = Field(1, ge=1, description="Publish weights every this many steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps (None: run until stopped)."
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    runtime: ModelConfig = Field(default_factory=ModelConfig)
    eval_every: int = Field(
        0, ge=0,
        description="Evaluate the task's held-out split ([task] eval: pass@1, pass@k) every "
        "this many steps, and at step 0 (0: never).",
    )  # fmt: skip
    metrics_file: Path | None = Field(None, description="Append one JSON line per step here.")
    loggers: list[LoggerName] = Field(
        ["jsonl"],
        description="Where each step's metrics row goes: 'jsonl' (metrics_file), "
        "'tensorboard' (event files), 'wandb' (a W&B run). The last two are extras: "
        "pip install 'flywheel[tensorboard]' / 'flywheel[wandb]'.",
    )
    log_dir: Path | None = Field(
        None,
        description="TensorBoard event files (<dir>/tensorboard/<run>/) and W&B runs "
        "(<dir>/wandb/) go here; None: beside metrics_file, else runs/logs.",
    )
    wandb_project: str = Field("flywheel", min_length=1, description="W&B project name.")
    wandb_mode: WandbMode = Field(
        "offline",
        description="'offline': W&B writes locally, no network ('wandb sync' uploads later); "
        "'online': streams to the W&B server.",
    )

    def train_config(self) -> TrainConfig:
        return TrainConfig(loss=self.loss, optim=self.optim, model=self.runtime)

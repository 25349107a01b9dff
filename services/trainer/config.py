"""Typed configuration of the training machinery (model, optimizer, batching).

Plain pydantic models, so the RL trainer service and `flywheel sft` embed
them as nested tables of their settings (`[sft.optim]`, `[trainer.loss]`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.trainer.core.config import LossConfig
from services.trainer.core.schedule import ScheduleKind


class OptimConfig(BaseModel):
    """AdamW and its learning-rate schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-6, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup length in optimizer steps.")
    schedule: ScheduleKind = Field("constant", description="After warmup: constant or cosine.")
    total_steps: int = Field(
        1000, ge=1, description="Steps over which the cosine schedule decays (ignored if constant)."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per RL batch: its groups are split into this many "
        "mini-batches (PPO-style); 1 = one step per batch.",
    )
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this; None: no clipping."
    )


class ModelConfig(BaseModel):
    """How the policy is loaded and sharded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    micro_batch_tokens: int = Field(
        8192, ge=1, description="Padded tokens (rows × longest row) per micro-batch."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in backward (saves memory)."
    )
    mixed_precision: bool = Field(
        True, description="On GPU: bf16 parameters/compute with fp32 gradient reduction."
    )
    seed: int = Field(0, description="Seed of torch's RNG at start-up.")
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU (process-wide); None: torch's default. "
        "Small models on a shared CPU run far faster with 1.",
    )


class TrainConfig(BaseModel):
    """Everything `Trainer` needs besides the model directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)

"""Typed configuration of the training machinery (model, optimizer, batching).

Plain pydantic models, so the RL trainer service and `flywheel sft` embed
them as nested tables of their settings (`[sft.optim]`, `[trainer.loss]`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.trainer.core.config import LossConfig
from services.trainer.core.schedule import ScheduleKind

Precision = Literal["auto", "bf16", "fp32"]
LogprobImpl = Literal["chunked", "full"]


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
    """How the policy is loaded, sharded and run (precision, layout, logprobs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Tokens per micro-batch: packed, the sum of the sequence lengths; "
        "padded, rows × longest row. A longer sequence gets a micro-batch of its own.",
    )
    packing: bool | Literal["auto"] = Field(
        "auto",
        description="Pack sequences into one row per micro-batch (position ids restart per "
        "sequence; attention never crosses sequences). False: one padded row per sequence. "
        "'auto': pack where the varlen attention kernel runs (a GPU in bf16/fp16); elsewhere "
        "a packed row attends through a dense block-diagonal mask, quadratic in the row's "
        "length (measured on the demo's CPU step: 1.5x slower than padding).",
    )
    precision: Precision = Field(
        "auto",
        description="'bf16': bf16 compute with float32 master weights, gradients and "
        "optimizer state (autocast in one process, FSDP2 mixed precision with float32 "
        "gradient reduction under torchrun); 'fp32': float32 throughout; 'auto': bf16 on a "
        "GPU that supports it, fp32 on CPU (CPU bf16 matmuls are no faster than fp32 on "
        "most CPUs, bench/results_trainer.md).",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in backward (saves memory)."
    )
    logprobs: LogprobImpl = Field(
        "chunked",
        description="'chunked': logprobs/entropy from the hidden states and the LM head a "
        "chunk of tokens at a time, never materialising [tokens × vocab] logits (verified "
        "for Qwen2/Qwen3/Llama/Mistral heads); 'full': the model's own logits (any model).",
    )
    logits_chunk_mib: float = Field(
        256.0,
        gt=0,
        description="'chunked' logprobs: MiB of float32 logits held at once (forward: "
        "rows = this / (4 · vocab); backward: the same number of elements, sliced over the "
        "vocabulary). Smaller saves memory, larger runs fewer, larger matmuls.",
    )
    entropy_every: int = Field(
        1,
        ge=0,
        description="Compute the token entropy metric every this many steps (0: never). "
        "With loss.entropy_coef > 0 it is computed on every step regardless.",
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

"""Settings of the buffer service (`[buffer]` in the run file)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class BufferSettings(ServiceSettings):
    section: ClassVar[str] = "buffer"
    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_BUFFER_", env_nested_delimiter="__", extra="forbid"
    )

    # what to generate
    source: Literal["arithmetic", "jsonl", "reasoning_gym"] = Field(
        "arithmetic", description="Task source: the built-in arithmetic task, a JSONL file, …"
    )
    dataset: Path | None = Field(None, description="JSONL file (source = 'jsonl').")
    dataset_name: str = Field("", description="reasoning-gym dataset name.")
    dataset_size: int = Field(
        100_000, ge=1, description="Procedural sources: number of distinct prompts."
    )
    env: str = Field(
        "arithmetic", description="Environment/verifier that scores the prompts' completions."
    )
    digits: int = Field(2, ge=1, le=9, description="Arithmetic: operand digits.")
    seed: int = Field(0, description="Seed of the dataset and its per-epoch shuffle.")
    samples_per_prompt: int = Field(8, ge=1, le=4096, description="Completions per prompt (n).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling.")
    max_new_tokens: int = Field(16, ge=1, description="Completion length limit.")
    stop: tuple[str, ...] = Field((), description="Stop strings.")

    # how batches are made
    groups_per_step: int = Field(32, ge=1, description="Prompts (groups) per optimizer step.")
    max_staleness: int = Field(
        1, ge=0, description="k: a sample of version w trains at step s only if w >= s - k."
    )
    oversample: float = Field(
        0.25, ge=0.0, le=4.0, description="Extra fraction of tasks to cover filtered groups."
    )
    filter_zero_variance: bool = Field(
        True, description="Drop groups whose rewards are all equal (no learning signal)."
    )
    max_response_tokens: int | None = Field(
        None, ge=1, description="Drop groups with a longer response (None: keep all)."
    )
    custom_filter: str | None = Field(
        None, description="'module:function' taking a SampleGroup, returning a reason or None."
    )
    dispatch_interval_s: float = Field(
        0.2, gt=0, description="How often admission is re-evaluated without an event."
    )
    keep_settled_steps: int = Field(
        8, ge=1, description="Remember batched group ids this many steps back (dedupe)."
    )

    @model_validator(mode="after")
    def _source_needs(self) -> BufferSettings:
        if self.source == "jsonl" and self.dataset is None:
            raise ValueError("source 'jsonl' needs 'dataset' (a JSONL file)")
        if self.source == "reasoning_gym" and not self.dataset_name:
            raise ValueError("source 'reasoning_gym' needs 'dataset_name'")
        return self

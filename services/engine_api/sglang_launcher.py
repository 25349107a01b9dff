"""`[stack] engine = "sglang"`: the command that starts a real SGLang server (GPU only).

A pure function, so `flywheel up --dry-run` and the tests check it without a
GPU; `flywheel up` runs it under its supervisor like any other process. The
flags (SGLang 0.5.x `ServerArgs`) are those the Kubernetes GPU overlay uses
(deploy/k8s/overlays/gpu/engine-sglang.yaml):

    python -m sglang.launch_server
        --model-path DIR            the Hugging Face directory (local, no hub)
        --host 127.0.0.1 --port N   where the HTTP API listens
        --weight-version V          the version /model_info reports at start
        --mem-fraction-static F     GPU memory for weights + KV cache (0.85)
        --tp-size K                 tensor parallel degree (the engine's GPUs)
        --dtype D                   model dtype ("auto")
        --random-seed S             sampler seed
        --enable-metrics            Prometheus /metrics
        --api-key KEY               only if set
        --skip-server-warmup        optional, faster start in tests
        --enable-deterministic-inference   optional: batch-invariant kernels,
                                           so rollout logprobs match a
                                           recomputation more closely
        --enable-lora --max-lora-rank R --lora-target-modules M.. --max-loras-per-batch K
                                    when LoRA adapters are served (`LoraServing`,
                                    the run file's `[engine]` enable_lora,
                                    max_lora_rank, lora_target_modules,
                                    max_loras_per_batch: one set of keys for the
                                    CPU engine and SGLang)

Weight updates then use `/update_weights_from_disk` with `weight_version`
(the same call as on the CPU engine), and pause/continue around it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head", "all",
)  # fmt: skip
"""`--lora-target-modules` choices for dense models (SGLang's SUPPORTED_LORA_TARGET_MODULES,
0.5.4-0.5.23, plus `all`)."""


@dataclass(frozen=True)
class LoraServing:
    """An engine that serves LoRA adapters: SGLang's four LoRA flags (no --lora-paths:
    adapters come and go through /load_lora_adapter)."""

    max_rank: int
    target_modules: tuple[str, ...]
    max_per_batch: int = 8

    def flags(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-lora-rank", str(self.max_rank),
            "--lora-target-modules", *self.target_modules,
            "--max-loras-per-batch", str(self.max_per_batch),
        ]  # fmt: skip


class EngineLoraSettings(BaseModel):
    """The run file's `[engine]` LoRA keys, one set for both engines: the CPU engine's
    settings have them (services/engine/settings.py), and `flywheel up` reads them for
    the SGLang engines it starts (`from_run_file`)."""

    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters: /load_lora_adapter, /unload_lora_adapter and "
        "/generate's lora_path (SGLang's --enable-lora). Needs max_lora_rank and "
        "lora_target_modules, as SGLang does when it starts with no --lora-paths.",
    )
    max_lora_rank: int | None = Field(
        None, ge=1, description="Largest adapter rank a load accepts (--max-lora-rank)."
    )
    lora_target_modules: list[str] | None = Field(
        None,
        description="Layers adapters may target (--lora-target-modules), e.g. "
        "['q_proj', 'v_proj'] or ['all']; an adapter targeting others is refused.",
    )
    max_loras_per_batch: int = Field(
        8,
        ge=1,
        description="Most distinct adapters in one running batch, the base model counting "
        "as one (--max-loras-per-batch, SGLang's default 8); others wait their turn.",
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _known_targets(cls, v: list[str] | None) -> list[str] | None:
        bad = [m for m in v or [] if m not in LORA_TARGET_MODULES]
        if bad:
            raise ValueError(
                f"unknown target module {bad[0]!r}; one of {list(LORA_TARGET_MODULES)}"
            )
        if v and "all" in v and len(v) > 1:
            raise ValueError(
                "If 'all' is specified in --lora-target-modules, it should be the only module "
                "specified."
            )
        return v

    @model_validator(mode="after")
    def _lora_complete(self) -> EngineLoraSettings:
        if self.enable_lora and not (self.max_lora_rank and self.lora_target_modules):
            raise ValueError(
                "enable_lora needs max_lora_rank and lora_target_modules (SGLang: When no "
                "initial --lora-paths is provided, you need to specify both --max-lora-rank "
                "and --lora-target-modules for LoRA initialization.)"
            )
        return self

    @property
    def lora(self) -> LoraServing | None:
        """The LoRA serving limits, or None when LoRA is off."""
        if not self.enable_lora or self.max_lora_rank is None or not self.lora_target_modules:
            return None
        return LoraServing(
            self.max_lora_rank, tuple(self.lora_target_modules), self.max_loras_per_batch
        )

    @classmethod
    def from_run_file(cls, doc: dict[str, Any]) -> EngineLoraSettings:
        """These keys of a parsed run file's `[engine]` table (the rest is the CPU engine's)."""
        table = doc.get("engine") or {}
        return cls.model_validate({k: v for k, v in table.items() if k in cls.model_fields})


@dataclass(frozen=True)
class SGLangOptions:
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 30000
    weight_version: str = "default"
    mem_fraction_static: float = 0.85
    tp_size: int = 1
    dtype: str = "auto"
    random_seed: int = 0
    api_key: str | None = None
    enable_metrics: bool = False
    skip_warmup: bool = False
    deterministic: bool = False
    lora: LoraServing | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def command(opts: SGLangOptions, python: str = sys.executable) -> list[str]:
    """The argv that starts SGLang with these options (pure)."""
    flags = {
        "--model-path": str(opts.model_path),
        "--host": opts.host,
        "--port": str(opts.port),
        "--weight-version": opts.weight_version,
        "--mem-fraction-static": str(opts.mem_fraction_static),
        "--tp-size": str(opts.tp_size),
        "--dtype": opts.dtype,
        "--random-seed": str(opts.random_seed),
    }
    argv = [python, "-m", "sglang.launch_server", *(x for kv in flags.items() for x in kv)]
    if opts.enable_metrics:
        argv.append("--enable-metrics")
    if opts.api_key:
        argv += ["--api-key", opts.api_key]
    if opts.skip_warmup:
        argv.append("--skip-server-warmup")
    if opts.deterministic:
        argv.append("--enable-deterministic-inference")
    if opts.lora is not None:
        argv += opts.lora.flags()
    return argv + list(opts.extra_args)

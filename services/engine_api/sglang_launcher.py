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

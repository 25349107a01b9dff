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
        --api-key KEY               only if set, and never on the command line:
                                    `python -m services.engine_api.keyed_launch
                                    sglang.launch_server ...` adds it in-process
                                    from FLYWHEEL_ENGINE_API_KEY (`environment`)
        --skip-server-warmup        optional, faster start in tests
        --enable-deterministic-inference   optional: batch-invariant kernels,
                                           so rollout logprobs match a
                                           recomputation more closely

Weight updates then use `/update_weights_from_disk` with `weight_version`
(the same call as on the CPU engine), and pause/continue around it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path


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
    # With a key: through keyed_launch, which adds `--api-key` from the environment
    # in-process, so no `ps` shows it.
    launch = ["services.engine_api.keyed_launch"] if opts.api_key else []
    argv = [python, "-m", *launch, "sglang.launch_server"]
    argv += [x for kv in flags.items() for x in kv]
    if opts.enable_metrics:
        argv.append("--enable-metrics")
    if opts.skip_warmup:
        argv.append("--skip-server-warmup")
    if opts.deterministic:
        argv.append("--enable-deterministic-inference")
    return argv + list(opts.extra_args)


def environment(opts: SGLangOptions) -> dict[str, str]:
    """What `command` needs in its environment: the API key, if any (never in argv)."""
    from services.engine_api.keyed_launch import ENV

    return {ENV: opts.api_key} if opts.api_key else {}

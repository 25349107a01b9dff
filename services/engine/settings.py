"""Settings of the CPU engine server (`[engine]` in the run file, FLYWHEEL_ENGINE_* env)."""

from __future__ import annotations

import os
from typing import ClassVar, Literal

from pydantic import Field, SecretStr, field_validator

from services.engine_api.sglang_api import (
    NEWEST_READ,
    Capabilities,
    UnsupportedEngine,
    fmt_release,
)
from services.engine_api.sglang_launcher import EngineLoraSettings
from services.runtime.settings import RunPath
from services.tasks.settings import TaskServiceSettings


def _sglang_env_bool(name: str, default: bool) -> bool:
    """SGLang's EnvBool reading of one of its own variables."""
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "y")


class EngineSettings(TaskServiceSettings, EngineLoraSettings):
    """The CPU engine: which model, where to listen, how much to batch, which LoRA
    adapters it may serve (`EngineLoraSettings`, shared with the SGLang launcher)."""

    section: ClassVar[str] = "engine"

    model: RunPath | None = Field(None, description="Hugging Face model directory to serve.")
    host: str = Field("127.0.0.1", description="Bind address (loopback unless told otherwise).")
    port: int = Field(30000, ge=0, le=65535, description="HTTP port (SGLang's default is 30000).")
    api_key: SecretStr | None = Field(
        None,
        description="If set, every path but /health*, /ready* and /metrics* requires "
        "'Authorization: Bearer <key>' (SGLang's --api-key).",
    )
    sglang_version: str = Field(
        fmt_release(NEWEST_READ),
        description="The SGLang release whose HTTP API this engine answers as: its routes, "
        "pause modes, duplicate-rid and flush rules (services/engine_api/sglang_api.py). "
        "Reported as `version` by /server_info.",
    )
    sampling_defaults: Literal["model", "openai"] = Field(
        "model",
        description="SGLang's --sampling-defaults: 'model' (its default) makes "
        "/v1/chat/completions take temperature, top_p, top_k, min_p and "
        "repetition_penalty a request leaves out from the model's generation_config.json; "
        "'openai' uses 1.0, 1.0, -1, 0.0, 1.0. /v1/completions and /generate always use "
        "the latter.",
    )
    weight_version: str = Field(
        "default", description="Version reported before the first update (SGLang's default)."
    )
    max_running_requests: int = Field(
        64, ge=1, le=4096, description="Most sequences decoded together in one batch."
    )
    prefix_cache_mib: float = Field(
        256.0,
        ge=0,
        description="The prefix cache's bound in MiB of KV (SGLang's radix cache; "
        "services/engine/core/prefix_cache.py): prompts' KV, reused by every request "
        "that starts with them, so a request's n samples and identical prompts in flight "
        "prefill their prompt once. Full: the least recently used prefixes are dropped "
        "until a new one fits; one larger than the bound is not kept (its samples still "
        "share it within their admission). /flush_cache and a weight update that "
        "flushes empty it. 0 switches it off (SGLang's --disable-radix-cache): every "
        "sample prefills its whole prompt. SmolLM2-135M keeps ~45 KiB per token.",
    )
    default_max_new_tokens: int = Field(
        128, ge=0, description="max_new_tokens when a request does not give one."
    )
    num_threads: int = Field(
        0, ge=0, description="torch intra-op threads for the model; 0 keeps torch's default."
    )
    random_seed: int = Field(0, description="Seed of the shared sampler for unseeded requests.")
    weights_check: Literal["sha256", "sizes"] = Field(
        "sha256",
        description=(
            "What an update checks against the directory's manifest before loading: "
            "'sha256' re-hashes every file (catches any corruption; ~0.25 s per 380 MB "
            "here, 4x the load itself), 'sizes' checks names and sizes only, trusting "
            "the transport's own check (the trainer's atomic write; the NATS "
            "download's hash on receipt). SGLang engines check neither."
        ),
    )
    health_generation: bool = Field(
        default_factory=lambda: _sglang_env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True),
        description="/health generates a token, as SGLang's does (false: /health answers at "
        "once; SGLang >= 0.5.6 only). Default: SGLang's own variable "
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, else true.",
    )
    health_check_timeout_s: float = Field(
        default_factory=lambda: float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")),
        gt=0,
        description="/health and /health_generate answer 503 when no token came for this long "
        "(e.g. while generation is paused). Default: SGLANG_HEALTH_CHECK_TIMEOUT, else 20.",
    )

    @field_validator("sglang_version")
    @classmethod
    def _supported(cls, v: str) -> str:
        try:
            Capabilities.of(v)
        except UnsupportedEngine as e:
            raise ValueError(str(e)) from e
        return v

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.of(self.sglang_version)

"""Settings of the CPU engine server (`[engine]` in the run file, FLYWHEEL_ENGINE_* env)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class EngineSettings(ServiceSettings):
    """The CPU engine: which model, where to listen, how much to batch."""

    section: ClassVar[str] = "engine"
    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_ENGINE_", env_nested_delimiter="__", extra="forbid"
    )

    model: Path | None = Field(None, description="Hugging Face model directory to serve.")
    host: str = Field("127.0.0.1", description="Bind address (loopback unless told otherwise).")
    port: int = Field(30000, ge=0, le=65535, description="HTTP port (SGLang's default is 30000).")
    api_key: SecretStr | None = Field(
        None,
        description="If set, admin endpoints (weights, pause, continue, abort, flush) "
        "require 'Authorization: Bearer <key>'.",
    )
    weight_version: str = Field(
        "default", description="Version reported before the first update (SGLang's default)."
    )
    max_running_requests: int = Field(
        64, ge=1, le=4096, description="Most sequences decoded together in one batch."
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
    health_generate_timeout_s: float = Field(
        20.0, gt=0, description="/health_generate fails when one token takes longer."
    )

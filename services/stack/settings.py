"""Settings of the local multi-process stack (`[stack]` in the run file)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class StackSettings(ServiceSettings):
    section: ClassVar[str] = "stack"
    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_STACK_", env_nested_delimiter="__", extra="forbid"
    )

    run_dir: Path = Field(Path("runs/demo"), description="Logs, NATS store, weights, metrics.")
    model: Path = Field(Path("runs/demo/model"), description="Initial model directory.")
    embedded_nats: bool = Field(
        True, description="Start a nats-server here; false: use [nats] url as given."
    )
    nats_port: int = Field(
        0, ge=0, le=65535, description="Embedded NATS port (0: free port); a cluster: port + i."
    )
    nats_cluster: int = Field(
        1,
        ge=1,
        le=5,
        description=(
            "Embedded nats-servers: 1, or 3 for a local JetStream cluster that survives the "
            "loss of one (set [nats] replicas = 3 with it)."
        ),
    )
    engines: int = Field(2, ge=0, le=64, description="CPU engines (one rollout worker each).")
    engine_threads: int = Field(1, ge=0, description="torch threads per engine (0: default).")
    trainer_nproc: int = Field(1, ge=1, description="Trainer ranks (>1 runs under torchrun).")
    services: tuple[str, ...] = Field(
        ("engine", "rollout", "sync", "trainer", "buffer"),
        description="Which services to start here (others run elsewhere, as pods do).",
    )
    on_failure: Literal["restart", "stop"] = Field(
        "restart", description="When a service dies: restart it, or stop the whole run."
    )
    max_restarts: int = Field(5, ge=0, description="Restarts per service before the run stops.")
    ready_timeout_s: float = Field(180.0, gt=0, description="Limit for a service to get ready.")
    stop_grace_s: float = Field(15.0, gt=0, description="SIGTERM → SIGKILL grace on shutdown.")
    status_interval_s: float = Field(2.0, gt=0, description="Refresh of the status view.")

    @model_validator(mode="after")
    def _replicas_fit_the_embedded_cluster(self) -> StackSettings:
        if self.embedded_nats and self.nats.replicas > self.nats_cluster:
            raise ValueError(
                f"[nats] replicas = {self.nats.replicas} needs at least that many servers, but "
                f"[stack] nats_cluster = {self.nats_cluster}: raise nats_cluster or lower replicas"
            )
        return self

"""Settings of a rollout worker (`[rollout]` in the run file)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr

from services.engine_api.teacher import TeacherSettings
from services.runtime.cores import CoreLeaseSettings
from services.runtime.settings import RunPath
from services.tasks.settings import TaskServiceSettings


class RolloutSettings(TaskServiceSettings):
    section: ClassVar[str] = "rollout"
    needs_task: ClassVar[bool] = True
    shared_tables: ClassVar[frozenset[str]] = TaskServiceSettings.shared_tables | {"teacher"}
    own_tables: ClassVar[dict[str, bool]] = {**TaskServiceSettings.own_tables, "teacher": False}

    engine_url: str = Field("http://127.0.0.1:30000", description="The engine beside this worker.")
    engine_id: str = Field(
        default_factory=lambda: f"engine-{socket.gethostname()}",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Engine id in heartbeats and samples (unique per engine).",
    )
    worker_id: str = Field(
        default_factory=lambda: f"rollout-{socket.gethostname()}",
        description="This worker's id, recorded in every group.",
    )
    engine_api_key: SecretStr | None = Field(
        None, description="Bearer key of the engine's admin API."
    )
    model: RunPath | None = Field(
        None, description="Model directory for the tokenizer (the engine's model)."
    )
    concurrency: int = Field(
        8, ge=1, le=1024, description="Tasks generated at once (fills the engine's batch)."
    )
    lora: bool = Field(
        False,
        description="The engine serves the run's LoRA versions as named adapters "
        "([trainer.lora] with [sync] lora_mode = 'adapter'; the engine started with "
        "enable_lora): sample with the newest adapter loaded there (its /v1/models, SGLang "
        ">= 0.5.5) as lora_path, and record that adapter's version in every sample.",
    )
    heartbeat_s: float = Field(1.0, gt=0, description="Engine heartbeat interval.")
    generate_timeout_s: float = Field(600.0, gt=0, description="Limit of one generate call.")
    verifier_timeout_s: float = Field(
        5.0, gt=0, description="Limit of one verifier call; a hang scores 0 and is counted."
    )
    sandbox_socket: RunPath | None = Field(
        None,
        description="Unix socket of a `flywheel sandbox` server: rewards and tools run in "
        "its children (a sidecar without this service's credentials or volumes) instead of "
        "this service's. None: this service starts the sandboxed children itself.",
    )
    max_abort_retries: int = Field(
        20, ge=0, description="Re-generations of a sample aborted by a weight update."
    )
    weights_dir: RunPath = Field(
        Path("runs/engine-weights"),
        description="Engine-local directory for weights received over NATS "
        "(<dir>/<run>/<engine_id>/v000012/); the engine must be able to read it.",
    )
    weights_poll_s: float = Field(
        2.0, gt=0, description="Re-read the newest WeightsPublished at least this often."
    )
    weights_keep: int = Field(
        2, ge=1, description="NATS-received versions kept locally (plus the one being served)."
    )
    weights_idle_timeout_s: float = Field(
        30.0, gt=0, description="A NATS weights download fails after this long with no chunk."
    )
    weights_fetch_attempts: int = Field(
        5,
        ge=1,
        description="Failed downloads of one weight version in a row before it is given up "
        "(reported; the engine waits for a newer version).",
    )
    teacher: TeacherSettings | None = Field(
        None,
        description="[teacher]: score every sample with a teacher's logprobs (on-policy "
        "distillation, docs/distillation.md); absent: no teacher.",
    )
    teacher_urls: list[str] = Field(
        default_factory=list,
        description="The teacher engines `flywheel up` started (set by it), used beside "
        "[teacher] urls.",
    )
    cores: CoreLeaseSettings = Field(
        default_factory=CoreLeaseSettings,
        description="[rollout.cores]: the machine's core lease (services/runtime/cores.py), "
        "set by `flywheel up` when [stack] placement is colocated: while tasks are in flight "
        "the worker sets its CPU engine's threads (/flywheel/num_threads) to what the lease "
        "gives, every core while the trainer waits for a batch. Off (no dir) otherwise.",
    )
    behind_retry_s: float = Field(
        0.5, gt=0, description="Task redelivery delay while the engine is older than it needs."
    )

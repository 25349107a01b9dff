"""Settings of the weight-sync service (`[sync]` in the run file)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr

from services.runtime.settings import RunPath
from services.tasks.settings import TaskServiceSettings


class SyncSettings(TaskServiceSettings):
    section: ClassVar[str] = "sync"

    weights_root: RunPath = Field(
        Path("runs/weights"), description="Shared weights directory (<root>/<run>/v000012/)."
    )
    update_mode: Literal["abort", "retract", "in_place", "wait"] = Field(
        "wait",
        description="How running requests meet an update: 'wait' lets them finish first; "
        "the others pause generation with that SGLang mode, update, then continue: "
        "'abort' ends them (the worker generates them again), 'retract' requeues them "
        "(they re-prefill with the new weights and go on), 'in_place' keeps them and "
        "their cache. retract and in_place keep partial rollouts (tokens from two "
        "versions, recorded per sample) and need SGLang >= 0.5.6; see docs/sglang.md "
        "for the GPU choice.",
    )
    engine_api_key: SecretStr | None = Field(
        None,
        description="Bearer key of the engines' API (SGLang's --api-key guards every path "
        "but /health* and /ready*).",
    )
    update_timeout_s: float = Field(300.0, gt=0, description="Limit of one engine's update.")
    liveness_s: float = Field(
        10.0, gt=0, description="An engine without a heartbeat this long is gone."
    )
    max_failures: int = Field(
        3, ge=1, description="Failed updates in a row before an engine stops holding up ready."
    )
    retry_backoff_s: float = Field(1.0, gt=0, description="First retry delay after a failure.")
    keep_last: int = Field(
        3, ge=1, description="Weight versions kept on disk; older ones are deleted."
    )
    tick_s: float = Field(
        0.2, gt=0, description="Reconcile at least this often (events also wake it at once)."
    )
    lora_mode: Literal["adapter", "merged"] = Field(
        "adapter",
        description="How engines take a LoRA version ([trainer.lora]): 'adapter' loads it "
        "as the named adapter v000012 beside the base (/load_lora_adapter; engines started "
        "with enable_lora), nothing paused; 'merged' folds it into its base model and loads "
        "that whole (/update_weights_from_disk), for engines that cannot serve adapters "
        "(sync must read the engine's copy and the base: same host or shared storage).",
    )
    lora_keep: int = Field(
        2,
        ge=1,
        description="LoRA adapters kept loaded per engine (the newest and the ones before "
        "it); older ones are unloaded, SGLang answering once no request uses them.",
    )
    distributed_address: str = Field(
        "127.0.0.1",
        min_length=1,
        description="weights_transport 'distributed': the address engines reach sync at to "
        "join its weight-update groups (rank 0 is sync). 127.0.0.1 when they share a host; "
        "the sync pod's IP on Kubernetes (FLYWHEEL_SYNC_DISTRIBUTED_ADDRESS from status.podIP).",
    )
    model: Path | None = Field(
        None,
        description="The engines' model directory, for the tokenizer of held-out evaluations "
        "on the engines ([trainer] eval_on = 'engines'); `flywheel up` sets it. None: an "
        "evaluation asked of sync is reported aborted, saying so.",
    )
    eval_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Limit of one held-out evaluation on an engine; past it the evaluation is "
        "reported aborted and the engine it held goes on to the newest version.",
    )
    eval_concurrency: int = Field(
        32,
        ge=1,
        le=1024,
        description="Held-out prompts generated at once on the evaluating engine (it batches "
        "them).",
    )
    verifier_timeout_s: float = Field(
        5.0, gt=0, description="Limit of one held-out answer's reward (the verifier sandbox)."
    )
    sandbox_socket: Path | None = Field(
        None,
        description="Unix socket of a `flywheel sandbox` server: the held-out answers' rewards "
        "run in its children instead of this service's. None: sync starts them itself.",
    )

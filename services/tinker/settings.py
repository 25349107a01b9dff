"""Settings of the Tinker-compatible service (`[tinker]` in the run file, FLYWHEEL_TINKER_* env)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr

from services.runtime.settings import RunPath, ServiceSettings


class TinkerSettings(ServiceSettings):
    """One base model, served to Tinker SDK clients: a LoRA adapter and Adam state per
    training client; sampling on the engines of `engines`, or in this process without them."""

    section: ClassVar[str] = "tinker"

    model: RunPath | None = Field(None, description="Hugging Face model directory of the base.")
    model_name: str | None = Field(
        None,
        description="The base_model name clients pass to create_lora_training_client "
        "(default: the model directory's name, e.g. 'SmolLM2-135M-Instruct').",
    )
    host: str = Field("127.0.0.1", description="Bind address (loopback unless told otherwise).")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    api_key: SecretStr | None = Field(
        None,
        description="If set, every /api/v1 route but healthz and client config requires "
        "'X-API-Key: <key>' (what the SDK sends from TINKER_API_KEY; it must start 'tml-').",
    )
    max_rank: int = Field(64, ge=1, le=1024, description="Largest LoRA rank a client may ask.")
    lora_alpha: float = Field(
        32.0,
        gt=0,
        description="lora_alpha of every adapter (the update is scaled by alpha / rank), "
        "as Tinker fixes it server-side rather than asking the client.",
    )
    max_datums: int = Field(
        256, ge=1, description="Most datums one forward/forward_backward request may carry."
    )
    max_tokens: int = Field(
        4096, ge=2, description="Longest model input (prompt + target) one datum may have."
    )
    batch_tokens: int = Field(
        4096,
        ge=1,
        description="Padded tokens (datums x the longest of them) one forward pass of a "
        "forward/forward_backward request runs at once: its datums run as right-padded "
        "batches of at most this many, whose float32 logits are batch_tokens x vocab x 4 "
        "bytes (4096 x SmolLM2's 49,152: 805 MB). The default is max_tokens' default, so a "
        "batch holds no more than one datum of the longest length the server accepts; a "
        "datum longer than this runs alone.",
    )
    max_num_samples: int = Field(64, ge=1, description="Most samples one sample request may ask.")
    max_sample_tokens: int = Field(
        1024, ge=1, description="Largest max_tokens a sample request may ask."
    )
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads for the model; 0 keeps torch's default "
        "(one per core). 1 suits a tiny model on a busy machine, where a thread team only "
        "waits on the other processes' cores.",
    )
    state_dir: RunPath = Field(
        Path("runs/tinker-state"),
        description="Where save_state writes training states (adapter, AdamW state, step "
        "count), one directory per tinker://<run>/weights/<name> path; they outlive the "
        "server, so a restarted one loads them (load_state, create_training_client_from_state).",
    )
    seed: int = Field(
        0,
        description="Seed of the sampler's generator when a request has none, and mixed into "
        "the seed of every adapter created without one (with its model id).",
    )
    engines: list[str] = Field(
        default_factory=list,
        description="Engine URLs (SGLang, or `flywheel engine`) that sample: each sampler's "
        "adapter is written under <state_dir>/.samplers/ and loaded on every engine by name "
        "(/load_lora_adapter), and sample / compute_logprobs go to an engine's /generate. The "
        "engines must run with LoRA on (--enable-lora, --max-lora-rank at least the ranks "
        "clients ask, --lora-target-modules all) and read that directory (same machine or a "
        "shared volume). Empty: sampling runs in this process, on the model thread.",
    )
    engine_timeout_s: float = Field(
        600.0, gt=0, description="How long one sample or adapter load may take on an engine."
    )
    journal_stream: str = Field(
        "",
        pattern=r"^[A-Za-z0-9_-]*$",
        description="The JetStream stream (at [nats] url) that logs every accepted request "
        "and its answer, so a restarted server rebuilds its sessions, adapters and "
        "optimizers and answers every future it gave (services/tinker/journal.py). "
        "Empty: the request log lives in memory and a restart loses it. One stream per "
        "server: two servers on one stream would replay each other's requests.",
    )
    journal_checkpoint_every: int = Field(
        100,
        ge=0,
        description="With a journal_stream: every this many optim_steps (all clients' "
        "together) the server writes a replay checkpoint (every model's adapter, gradients, "
        "AdamW state and steps, the sessions, samplers and request log) under "
        "checkpoint_dir, records it on the stream and purges the records the checkpoint "
        "before it covers, so a restart replays at most about two intervals of requests "
        "and the stream stays bounded (services/tinker/journal.py). Requests wait while the "
        "state is copied. 0: no checkpoints; a restart replays the whole stream.",
    )
    checkpoint_dir: RunPath = Field(
        Path("runs/tinker-checkpoints"),
        description="Where the journal's replay checkpoints are written, one directory "
        "per checkpoint under <checkpoint_dir>/<journal_stream>/ (the newest two are kept). "
        "A restart needs it: keep it beside the NATS data, on a volume that outlives the "
        "server.",
    )

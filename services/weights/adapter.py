"""A LoRA adapter version: PEFT's layout, its settings, what it says of itself, its rules.

With `[trainer.lora]` (`LoraSettings`) a published version is not a whole
model but a LoRA adapter of the run's base model, in the layout PEFT
writes and SGLang's `/load_lora_adapter` reads (lora/lora_config.py,
lora/lora_manager.py):

    adapter_config.json         PEFT's LoraConfig: r, lora_alpha, target_modules, ...
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight [r, in] and
                                .lora_B.weight [out, r]; an embedding's are
                                .lora_embedding_A [r, vocab] and .lora_embedding_B [dim, r]
    flywheel-manifest.json      the weights manifest (manifest.py), as for any version

It travels as a whole version does (the same directory layout, manifest
and sha256, the same `disk` and `nats` transports): only what is in the
directory differs, a few megabytes instead of the model. Deltas are
refused for adapters (`check_transport`): an adapter is already the small
thing, and all of it changes at every step. The base model is the one
each engine was started with; an adapter names its base
(`base_model_name_or_path`, the trainer's model directory), and
`WeightsPublished.format = "peft-lora"` says on the wire that a version is
an adapter (engines load it by name: services/weights/adapter_load.py).

Pure (json, pydantic): engines, sync and the stack read this; the trainer
writes it (services/trainer/lora.py), merge.py folds one into its base.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.runtime.errors import ConfigError, FlywheelError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
"""PEFT's prefix of every saved tensor name (the PeftModel's path to the base model)."""

LoraHead = Literal["lm_head", "embed_tokens"]
HEADS: tuple[str, ...] = ("lm_head", "embed_tokens")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(BaseModel):
    """`[trainer.lora]` (and `[sft.lora]`): train a LoRA adapter instead of every weight.

    Absent: full fine-tuning. Present: PEFT adds a rank-`rank` pair A, B
    beside each target module (B starts at zero, so step 0 is the base),
    every base weight is frozen, and each published version is the adapter
    alone (services/trainer/lora.py).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(
        8,
        ge=1,
        le=1024,
        description="r: the adapter's rank. Its size is r · (in + out) per target module; "
        "SmolLM2-135M with the default targets: 2.4M parameters at rank 8 (1.8% of the model).",
    )
    alpha: float = Field(
        16.0,
        gt=0,
        description="lora_alpha: the update is scaled by alpha / rank (PEFT's convention; "
        "keep alpha / rank when changing the rank to keep the learning rate meaningful).",
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training (0: none; RL usually "
        "runs without). Not with heads = ['lm_head'] and chunked logprobs.",
    )
    target_modules: tuple[str, ...] = Field(
        DEFAULT_TARGETS,
        min_length=1,
        description="Module names (the last part of the module path) that get an adapter: "
        "the attention and MLP projections by default (Qwen2, Llama, Mistral names; SGLang "
        "serves these). The LM head and the input embedding are `heads`.",
    )
    heads: tuple[LoraHead, ...] = Field(
        (),
        description="Also adapt the output head ('lm_head') and/or the input embedding "
        "('embed_tokens'). With tied embeddings (SmolLM2, small Qwens) the two share one base "
        "matrix but each gets an adapter of its own, as in PEFT and SGLang (which serves "
        "head adapters from 0.5.7). An 'lm_head' adapter costs r · (hidden + vocab).",
    )

    @field_validator("target_modules")
    @classmethod
    def _plain_modules(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        heads = sorted(set(v) & set(HEADS))
        if heads:
            raise ValueError(f"{heads} are heads: list them in `heads`, not target_modules")
        if any(not m or "." in m for m in v):
            raise ValueError("module names are the last part of a module path (e.g. 'q_proj')")
        if len(set(v)) != len(v):
            raise ValueError("a module is listed twice")
        return v

    @property
    def modules(self) -> tuple[str, ...]:
        """Every module name that gets an adapter (targets, then heads)."""
        return (*self.target_modules, *self.heads)


class AdapterError(FlywheelError, ValueError):
    """A directory is not a readable PEFT LoRA adapter; names the path and why."""

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter says about itself (the fields SGLang's LoRAConfig reads, and its base)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base: str  # base_model_name_or_path: where the trainer's base model was
    use_dora: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's `lora_alpha / r` (Flywheel never writes use_rslora)."""
        return self.alpha / self.rank


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a LoRA adapter (its config) rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def parse_config(doc: Any, path: Path) -> AdapterConfig:
    """An adapter_config.json document as an AdapterConfig; AdapterError naming the problem."""
    if not isinstance(doc, dict):
        raise AdapterError(f"{path}/{ADAPTER_CONFIG} is not a JSON object", path=path)
    if doc.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {doc['peft_type']!r} is not LORA", path=path)
    try:
        targets = doc["target_modules"]
        if isinstance(targets, str):  # PEFT's "all-linear" shorthand
            targets = [targets]
        return AdapterConfig(
            rank=int(doc["r"]),
            alpha=float(doc["lora_alpha"]),
            target_modules=tuple(sorted(str(t) for t in targets)),
            base=str(doc.get("base_model_name_or_path") or ""),
            use_dora=bool(doc.get("use_dora") or False),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"{path}/{ADAPTER_CONFIG}: bad or missing {e}", path=path) from e


def read_config(path: str | Path) -> AdapterConfig:
    """The adapter config of directory `path`; AdapterError if it has none or a bad one."""
    p = Path(path)
    try:
        doc = json.loads((p / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{p}: no readable {ADAPTER_CONFIG} ({e})", path=p) from e
    return parse_config(doc, p)


def module_of(key: str) -> tuple[str, str] | None:
    """A saved tensor name as (module path, "A" or "B"), None if it is not LoRA's:
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ->
    ("model.layers.0.self_attn.q_proj", "A"); an embedding's `lora_embedding_B` -> "B"."""
    name = key.removeprefix(KEY_PREFIX)
    for marker, part in (
        (".lora_A.weight", "A"),
        (".lora_B.weight", "B"),
        (".lora_embedding_A", "A"),
        (".lora_embedding_B", "B"),
    ):
        if name.endswith(marker):
            return name[: -len(marker)], part
    return None


def check_transport(kind: str) -> None:
    """ConfigError unless adapters travel by weights transport `kind` (checked at start-up)."""
    if kind in ("nats-delta", "disk-delta"):
        raise ConfigError(
            f"[trainer] weights_transport = {kind!r} with [trainer.lora]: deltas are off for "
            "LoRA adapters (an adapter is already a few MB, and all of it changes at every "
            "step); use 'disk' or 'nats'"
        )
    if kind == "distributed":
        raise ConfigError(
            "[trainer] weights_transport = 'distributed' with [trainer.lora]: it broadcasts a "
            "whole model's tensors into the engine's weights, not adapters; use 'disk' or 'nats'"
        )

"""SGLang's LoRA rules, pure: adapter configs, what an engine can serve, its error texts.

Read from SGLang's source (0.5.4 and 0.5.23 wheels): `srt/lora/lora_config.py`
(an adapter is a PEFT `adapter_config.json`: `r`, `lora_alpha`,
`target_modules`, `use_dora`), `srt/lora/utils.py::get_normalized_target_modules`
(q/k/v_proj serve as `qkv_proj`, gate/up_proj as `gate_up_proj`),
`srt/lora/mem_pool.py::can_support` (rank <= `--max-lora-rank`, targets within
`--lora-target-modules`), `srt/lora/lora_manager.py::validate_new_adapter`
and `validate_lora_batch` (at most `--max-loras-per-batch` distinct adapters,
the base model counting as one, in a running batch), and
`srt/lora/lora_registry.py` (names, the texts of its ValueErrors). The texts
are SGLang's to the character, `odict_keys([...])` included, because a
client may match them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from services.runtime.errors import FlywheelError

_NORMALIZED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "vocab_emb": "embed_tokens",
    "embeddings": "embed_tokens",
    "word_embeddings": "embed_tokens",
    "output": "lm_head",
    "unembed_tokens": "lm_head",
}


class LoraError(FlywheelError, ValueError):
    """A LoRA request SGLang refuses; the message is SGLang's."""


def normalized_targets(modules: str | Iterable[str]) -> set[str]:
    """SGLang's `get_normalized_target_modules`: {"all"} for PEFT's shorthands."""
    if isinstance(modules, str):
        if modules not in ("all", "all-linear"):
            raise LoraError(
                "Only 'all' or 'all-linear' can be used as the string for target module"
            )
        return {"all"}
    return {_NORMALIZED.get(m.split(".")[-1], m.split(".")[-1]) for m in modules}


@dataclass(frozen=True)
class AdapterConfig:
    """What SGLang reads of a PEFT `adapter_config.json` (`LoRAConfig`)."""

    r: int
    lora_alpha: float
    target_modules: str | tuple[str, ...]
    use_dora: bool = False
    use_rslora: bool = False  # read to warn: SGLang scales by alpha / r regardless
    added_tokens: int = 0  # added_tokens.json entries at or above the base vocabulary

    @property
    def scaling(self) -> float:
        """SGLang's `LoRAAdapter.scaling` = lora_alpha / r (it ignores `use_rslora`)."""
        return self.lora_alpha / self.r

    @classmethod
    def from_json(cls, doc: dict[str, Any], added_tokens: int = 0) -> AdapterConfig:
        """The fields SGLang reads; a missing one is the KeyError SGLang's load reports."""
        targets = doc["target_modules"]
        return cls(
            r=int(doc["r"]),
            lora_alpha=float(doc["lora_alpha"]),
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            use_dora=bool(doc.get("use_dora", False)),
            use_rslora=bool(doc.get("use_rslora", False)),
            added_tokens=added_tokens,
        )


@dataclass(frozen=True)
class AdapterRef:
    """SGLang's `LoRARef`: one load of one adapter (a new id for every load of a name)."""

    name: str
    path: str
    pinned: bool = False
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class LoraLimits:
    """What the engine was started for (`--max-lora-rank`, `--lora-target-modules`,
    `--max-loras-per-batch`)."""

    max_rank: int
    target_modules: frozenset[str]  # normalized; {"all"}: every linear layer
    max_per_batch: int

    def can_support(self, config: AdapterConfig) -> bool:
        """`LoRAMemoryPool.can_support`."""
        if config.r > self.max_rank:
            return False
        targets = normalized_targets(config.target_modules)
        return "all" in targets or "all" in self.target_modules or targets <= self.target_modules


def keys_repr(names: Iterable[str], kind: str = "odict_keys") -> str:
    """How SGLang's messages print a registry's keys: `odict_keys(['a', 'b'])`."""
    return f"{kind}({list(names)!r})"


# ── SGLang's messages ─────────────────────────────────────────────────────────
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""load/unload_lora_adapter with LoRA off (tokenizer_manager)."""


def generate_not_enabled(name: str | None) -> str:
    """0.5.23 `_validate_and_resolve_lora`: a /generate naming an adapter, LoRA off."""
    return (
        f"LoRA adapter '{name}' was requested, but LoRA is not enabled. "
        "Please launch the server with --enable-lora flag and preload adapters "
        "using --lora-paths or /load_lora_adapter endpoint."
    )


def validate_new_adapter(
    config: AdapterConfig,
    ref: AdapterRef,
    loaded: Iterable[AdapterRef],
    limits: LoraLimits,
    pinned_count: int,
) -> None:
    """`LoRAManager.validate_new_adapter` (0.5.23 order; 0.5.4 lacks the first two checks,
    which only refuse adapters it would have served wrongly)."""
    if config.added_tokens > 0:
        raise LoraError(
            f"Failed to load {ref.name} because LoRA serving currently doesn't support "
            "adapters that add tokens to the vocabulary"
        )
    if config.use_dora:
        raise LoraError(
            f"Failed to load {ref.name} because LoRA serving currently doesn't support "
            "DoRA adapters"
        )
    if any(ref.name == other.name for other in loaded):
        raise LoraError(f"Failed to load LoRA adapter {ref.name} because it is already loaded")
    if not limits.can_support(config):
        raise LoraError(
            f"LoRA adapter {ref.name} with rank {config.r} is incompatible with the current "
            "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is "
            "within the configured `--max-lora-rank` and that the target modules are "
            "included in `--lora-target-modules`."
        )
    if ref.pinned and pinned_count >= limits.max_per_batch - 1:
        raise LoraError(
            f"Failed to load LoRA adapter {ref.name} as a pinned adapter. It is not allowed "
            "to pin all slots in the LoRA memory pool to avoid starvation for unpinned "
            "adapters and base models. Please increase your `--max-loras-per-batch` or "
            "load it as unpinned LoRA adapters."
        )


def batch_fits(lora_ids: set[str | None], pinned: set[str], max_per_batch: int) -> bool:
    """`LoRAManager.validate_lora_batch`: may these adapters (None: the base model) run in
    one batch? Pinned adapters hold their own slots."""
    if len(lora_ids) > max_per_batch:
        return False
    if not pinned:
        return True
    pinned_in_batch = sum(1 for i in lora_ids if i is not None and i in pinned)
    return len(lora_ids) - pinned_in_batch <= max_per_batch - len(pinned)

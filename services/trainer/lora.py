"""LoRA training: a PEFT adapter on the policy, and the adapter as what a version is.

`[trainer.lora]` (`LoraSettings`, services/weights/adapter.py) replaces full
fine-tuning: PEFT (the ecosystem's library, pinned in the `lora` extra)
puts a rank-r pair A [r, in], B [out, r] beside each target module,
freezes every base weight, and only A and B train (B starts at zero, so
step 0 is the base model). `apply` hands back the Hugging Face model itself
with the LoRA layers inside it, not PEFT's wrapper: the rest of the trainer
(FSDP2's `fully_shard` per decoder layer, the chunked logprobs through the
LM head, activation checkpointing, the optimizer over the parameters that
require grad) sees the model class and module tree it always sees.

What leaves the trainer is the adapter alone, in PEFT's saved layout:
`adapter_tensors` renames the live parameters
(`model.layers.0.self_attn.q_proj.lora_A.default.weight`) to PEFT's file
names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`),
which is what `get_peft_model_state_dict` gives (a unit test holds them
equal) without needing PEFT's wrapper under FSDP2; `write_adapter` writes
them beside PEFT's `adapter_config.json`. Checkpoints hold the adapter and
its AdamW state only (stateformat.py leaves frozen parameters out): the
base never changes and is the run's model directory.

An adapted LM head (`heads = ["lm_head"]`) is still one matmul in the
chunked logprobs: `head_parameters` gives W + (alpha / r) · B @ A, the head
PEFT runs when dropout is 0 (the settings refuse dropout there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from services.runtime.errors import ConfigError
from services.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, KEY_PREFIX, LoraSettings

ADAPTER = "default"  # PEFT's name of a model's one adapter


def peft_config(s: LoraSettings, base: str = "") -> Any:  # -> peft.LoraConfig
    from peft import LoraConfig

    return LoraConfig(
        r=s.rank,
        lora_alpha=s.alpha,  # type: ignore[arg-type]  # PEFT types it int; floats work
        lora_dropout=s.dropout,
        target_modules=list(s.modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
    )


def config_doc(s: LoraSettings, base: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for these settings, as `LoraConfig.save_pretrained` writes
    it (sets as lists, inference_mode true), naming `base` as the base model."""
    cfg = peft_config(s, base)
    cfg.inference_mode = True
    return {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.to_dict().items()}


def check_base(model_dir: str | Path) -> None:
    """ConfigError if the run's model is itself an adapter: a new adapter's versions name
    their base (`base_model_name_or_path`) for the engines and for merges, and that must
    be a whole model (an SFT adapter: merge it first, or train on from its base)."""
    from services.weights.adapter import is_adapter_dir

    if is_adapter_dir(model_dir):
        raise ConfigError(
            f"[trainer.lora] on {model_dir}, itself a LoRA adapter: start from a whole model "
            "(merge the adapter into its base first: services/weights/merge.merge_into)"
        )


def apply(model: torch.nn.Module, s: LoraSettings) -> torch.nn.Module:
    """Put the adapter into `model` (in place) and return it, only the adapter trainable.

    ConfigError naming `[trainer.lora]` when a target module is not in the model.
    """
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        # A tied head with an adapter of its own is what heads = ["lm_head"] asks for: the
        # deltas are untied by design (merge.py unties the merged head; SGLang serves it so).
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*")
        # PEFT 0.21 still asks transformers for `is_gradient_checkpointing` (renamed in 5.x).
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        try:
            wrapped = get_peft_model(model, peft_config(s))
        except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
            raise ConfigError(f"[trainer.lora] target_modules / heads: {e}") from e
    return wrapped.get_base_model()  # the HF model, with the LoRA layers inside


def trained_only(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without the frozen base: torch's `ignore_frozen_params` still reports a tied
    head under its own name (`lm_head.weight`, the frozen embedding), so filter by name."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in state.items() if n in trained}


def saved_name(live: str) -> str | None:
    """A live parameter's name as PEFT saves it, None if it is not the adapter's:
    `…q_proj.lora_A.default.weight` -> `base_model.model.…q_proj.lora_A.weight`,
    `…embed_tokens.lora_embedding_A.default` -> `base_model.model.…lora_embedding_A`."""
    if ".lora_" not in live:
        return None
    return KEY_PREFIX + ".".join(p for p in live.split(".") if p != ADAPTER)


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a model state dict (on CPU), under PEFT's saved names."""
    out = {}
    for live, t in state.items():
        name = saved_name(live)
        if name is not None:
            out[name] = t.detach().contiguous()
    return out


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
    """PEFT's two files into `directory` (its manifest is the caller's: write_weights_dir)."""
    from safetensors.torch import save_file

    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(doc, indent=2, sort_keys=True))


def head_parameters(head: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, H], bias) that the LM head applies: its own, or W + s · B @ A."""
    base = getattr(head, "base_layer", None)
    if base is None:
        return head.weight, head.bias
    a = head.lora_A[ADAPTER].weight  # [r, H]
    b = head.lora_B[ADAPTER].weight  # [V, r]
    return base.weight + (b @ a) * head.scaling[ADAPTER], base.bias


def plain_linear(head: torch.nn.Module | None) -> bool:
    """The head is a Linear, or PEFT's LoRA layer around one."""
    return isinstance(getattr(head, "base_layer", head), torch.nn.Linear)

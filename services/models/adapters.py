"""A LoRA adapter directory as a model: its base, with the adapter merged in.

`flywheel eval --weights <adapter>`, and a trainer or SFT run whose model
is an adapter (the output of an SFT run with `[sft.lora]`), load it here:
the base model named by the adapter (`base_model_name_or_path`, what the
trainer wrote: its model directory; or `base`, given), resolved as any
model reference is (resolve.py), with the adapter's low-rank updates added
to its weights (services/weights/merge.py, PEFT's merge arithmetic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.models.resolve import resolve_model
from services.weights.adapter import read_config


def base_of(adapter_dir: str | Path, base: str | Path | None = None) -> Path:
    """The base model directory of an adapter: `base` if given, else the one it names."""
    ref = base or read_config(adapter_dir).base
    key = "the base model" if base else f"{adapter_dir}'s base_model_name_or_path"
    return resolve_model(ref or "", key=key)


def load_merged(adapter_dir: str | Path, base: str | Path | None = None, dtype: Any = None) -> Any:
    """The base causal LM with the adapter merged into its weights (transformers, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.weights.merge import merge_state, read_adapter

    root = base_of(adapter_dir, base)
    model = AutoModelForCausalLM.from_pretrained(
        root, local_files_only=True, dtype=dtype or torch.float32
    )
    _, modules = read_adapter(Path(adapter_dir))
    if "lm_head" in modules and getattr(model.config, "tie_word_embeddings", False):
        # An adapted head is no longer the embedding: it gets a tensor of its own first.
        model.config.tie_word_embeddings = False
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    state = model.state_dict()
    merged = merge_state(dict(state), Path(adapter_dir))
    with torch.no_grad():
        for name, t in state.items():
            if merged[name] is not t:
                t.copy_(merged[name])
    return model

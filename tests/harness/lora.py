"""LoRA adapter directories for tests, in PEFT's layout, made without peft.

`adapter_config.json` + `adapter_model.safetensors` with
`base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight`
[out, r], exactly what `PeftModel.save_pretrained` writes for a LoRA on
linear layers (the correctness test compares against real peft).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_adapter(
    out: Path,
    model_dir: Path,
    *,
    r: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 1,
    scale: float = 0.5,
) -> Path:
    """A random adapter (B nonzero, so it changes the output) for the model at `model_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in targets and isinstance(module, torch.nn.Linear):
            a = torch.randn(r, module.in_features, generator=gen) * scale
            b = torch.randn(module.out_features, r, generator=gen) * scale
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    doc = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
           "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
           "base_model_name_or_path": str(model_dir)}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(doc))
    return out

"""Loading a local Hugging Face causal LM and sharding it with FSDP2.

FSDP2 (`fully_shard`) wraps each decoder layer, then the root, so each
layer's parameters are all-gathered just before it runs and freed after:
peak memory is one layer's full parameters plus the shards. Decoder layers
are found by the model's own `_no_split_modules` class names (what
transformers uses for device maps), so Qwen2, Llama, Mistral, … need no
per-architecture code. On GPU a MixedPrecisionPolicy computes in bf16 and
reduces gradients in fp32; on CPU everything stays fp32 (gloo).
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.errors import FlywheelError
from services.trainer.distributed import DistInfo


class ModelLoadError(FlywheelError, OSError):
    """A model directory is missing or not a loadable HF causal-LM directory."""

    def __init__(self, message: str, *, path: Path):
        super().__init__(message)
        self.path = path


def _check_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model directory not found: {p}", path=p)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p} has no config.json: not a Hugging Face model dir", path=p)
    return p


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """AutoModelForCausalLM from a local directory only (never a hub)."""
    from transformers import AutoModelForCausalLM

    p = _check_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load a causal LM from {p}: {e}", path=p) from e
    return model


def load_tokenizer(path: str | Path):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    p = _check_dir(path)
    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {p}: {e}", path=p) from e


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers, by the class names in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ModelLoadError(
            f"{type(model).__name__} declares no decoder layer class (_no_split_modules)",
            path=Path("."),
        )
    return layers


def prepare_model(
    model: torch.nn.Module,
    info: DistInfo,
    *,
    activation_checkpointing: bool = False,
    mixed_precision: bool = True,
    trainable: bool = True,
) -> torch.nn.Module:
    """Move to the device, optionally checkpoint activations, and FSDP2-shard if distributed."""
    model.to(info.device)
    if activation_checkpointing and trainable:
        enable = model.gradient_checkpointing_enable  # a transformers PreTrainedModel method
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    if not info.distributed:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()  # fp32 everywhere (CPU, or mixed precision off)
    if mixed_precision and info.device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model

"""Loading a local Hugging Face causal LM, its precision, and sharding it with FSDP2.

FSDP2 (`fully_shard`) wraps each decoder layer, then the root, so each
layer's parameters are all-gathered just before it runs and freed after:
peak memory is one layer's full parameters plus the shards. Decoder layers
are found by the model's own `_no_split_modules` class names (what
transformers uses for device maps), so Qwen2, Llama, Mistral, … need no
per-architecture code.

Precision. Parameters, gradients and AdamW state are float32 (the master
copy) in every configuration. With bf16 compute, FSDP2's
MixedPrecisionPolicy all-gathers bf16 parameters and reduces gradients in
float32 (CPU/gloo and GPU/NCCL alike); a single process gets the same
from autocast (services/trainer/forward.py), which casts each matmul's
inputs to bf16 and leaves norms, softmax statistics and the optimizer in
float32. A frozen reference model needs no master copy and is held in the
compute dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.runtime.errors import FlywheelError
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
    """AutoModelForCausalLM from a local directory only (never a hub); a LoRA adapter
    directory is its base model with the adapter merged in (services/models/adapters.py)."""
    from transformers import AutoModelForCausalLM

    from services.weights.adapter import is_adapter_dir

    if is_adapter_dir(path):
        from services.models.adapters import load_merged

        return load_merged(path, dtype=dtype)
    p = _check_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load a causal LM from {p}: {e}", path=p) from e
    return model


def load_tokenizer(path: str | Path):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    from services.weights.adapter import is_adapter_dir

    if is_adapter_dir(path):  # an adapter's tokenizer is its base's
        from services.models.adapters import base_of

        path = base_of(path)
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


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The matmul dtype of a `precision` setting ('auto', 'bf16', 'fp32') on `device`."""
    if precision == "fp32":
        return torch.float32
    gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "bf16":
        if device.type == "cuda" and not gpu_bf16:
            raise ModelLoadError(f"precision='bf16' but {device} has no bf16", path=Path("."))
        return torch.bfloat16
    if precision == "auto":
        return torch.bfloat16 if gpu_bf16 or cpu_bf16(device) else torch.float32
    raise ValueError(f"unknown precision {precision!r}")


def cpu_bf16(device: torch.device) -> bool:
    """Whether `device` is a CPU with native bf16 matmuls (AVX512-BF16 or AMX): there bf16
    autocast was measured 1.3-1.9x faster than float32 on a real model's step
    (bench/results_real_profile.md); without them bf16 is emulated and no faster."""
    return device.type == "cpu" and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )


# Causal LMs whose forward is exactly `logits = lm_head(final hidden states)`
# (read in transformers' modeling code): the chunked logprobs may stand in for
# the head. Others (Gemma's soft-capping, Cohere's logit_scale, …) post-process.
PLAIN_HEAD_MODELS = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)


def check_plain_head(model: torch.nn.Module) -> None:
    """Raise unless the chunked logprobs compute exactly what the model's head does."""
    from services.trainer.lora import plain_linear

    name = type(model).__name__.removeprefix("FSDP")
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if name not in PLAIN_HEAD_MODELS or not plain_linear(head):  # a Linear, or LoRA around one
        raise ModelLoadError(
            f"logprobs='chunked' is verified for {', '.join(sorted(PLAIN_HEAD_MODELS))}; "
            f"{name} may post-process its logits: set [trainer.runtime] logprobs = 'full'",
            path=Path("."),
        )


def prepare_model(
    model: torch.nn.Module,
    info: DistInfo,
    *,
    activation_checkpointing: bool = False,
    dtype: torch.dtype = torch.float32,
    trainable: bool = True,
    attention: str | None = None,
) -> torch.nn.Module:
    """Move to the device, set attention, checkpoint activations, and FSDP2-shard if distributed.

    `dtype` is the compute dtype; parameters stay float32 when `trainable`.
    `attention`: a transformers attention implementation name (None: keep).
    """
    model.to(info.device)
    if attention is not None:
        model.set_attn_implementation(attention)  # type: ignore[operator]
    if activation_checkpointing and trainable:
        enable = model.gradient_checkpointing_enable  # a transformers PreTrainedModel method
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    if not info.distributed:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()  # the parameters' dtype everywhere
    if dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model

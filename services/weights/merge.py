"""A LoRA adapter folded into its base: whole weights, for whoever cannot apply adapters.

W' = W + (alpha / r) · B @ A for every adapted Linear, and for an adapted
embedding W' = W + (alpha / r) · (B @ A)ᵀ (PEFT's `lora_embedding_A` is
[r, vocab]), computed in float32 and cast back to W's dtype: PEFT's
`merge_and_unload` arithmetic, done on tensors by name so that it needs no
PEFT and no model class. Two users:

- `merge_into`: a new weights directory (the base's files with the merged
  safetensors, atomic, with its manifest), for sync's `merged` mode
  (engines that cannot serve adapters load it with /update_weights_from_disk);
- `merge_state`: a base model's state dict in memory, for loading an
  adapter directory as a model (`flywheel eval --weights <adapter>`, a
  trainer or SFT run started from an adapter).

A tied LM head (`tie_word_embeddings`) with an adapter of its own is
untied: the merged head differs from the embedding, so the result holds
an `lm_head.weight` of its own and the directory's config says
`tie_word_embeddings = false`.

torch and safetensors are imported inside the functions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from services.weights.adapter import (
    ADAPTER_WEIGHTS,
    AdapterConfig,
    AdapterError,
    module_of,
    read_config,
)
from services.weights.manifest import MANIFEST_NAME, Manifest, write_weights_dir

if TYPE_CHECKING:
    import torch

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def read_adapter(adapter_dir: Path) -> tuple[AdapterConfig, dict[str, dict[str, torch.Tensor]]]:
    """An adapter's config and its tensors by module path: {module: {"A": …, "B": …}}."""
    from safetensors.torch import load_file

    cfg = read_config(adapter_dir)
    try:
        raw = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    except (OSError, ValueError, RuntimeError) as e:
        raise AdapterError(
            f"{adapter_dir}: unreadable {ADAPTER_WEIGHTS}: {e}", path=adapter_dir
        ) from e
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        where = module_of(key)
        if where is not None:
            pairs.setdefault(where[0], {})[where[1]] = t
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{adapter_dir}: {module} lacks lora_A or lora_B", path=adapter_dir)
    return cfg, pairs


def merge_state(state: dict[str, torch.Tensor], adapter_dir: Path) -> dict[str, torch.Tensor]:
    """`state` (an HF model's tensors by name) with the adapter merged in: a new dict, the
    adapted tensors new, the others shared with `state`."""
    cfg, pairs = read_adapter(adapter_dir)
    out = dict(state)
    for module, ab in pairs.items():
        name = f"{module}.weight"
        if name not in out and name == HEAD and EMBED in out:
            out[name] = out[EMBED]  # tied: the head is the embedding, until merged
        if name not in out:
            raise AdapterError(f"{adapter_dir}: the base model has no {name}", path=adapter_dir)
        w = out[name]
        delta = ab["B"].float() @ ab["A"].float()  # [out, in]; an embedding's: [dim, vocab]
        if delta.shape != w.shape:
            delta = delta.t()
        if delta.shape != w.shape:
            raise AdapterError(
                f"{adapter_dir}: {module}'s update is {tuple(delta.shape)}, "
                f"the base's {tuple(w.shape)}",
                path=adapter_dir,
            )
        out[name] = (w.float() + delta * cfg.scaling).to(w.dtype).contiguous()
    return out


def _base_tensors(base_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise AdapterError(f"{base_dir} has no *.safetensors", path=base_dir)
    return state


def merge_into(
    base_dir: Path, adapter_dir: Path, out: Path, *, overwrite: bool = False
) -> Manifest:
    """Write `out`: base directory `base_dir` with the adapter merged in (atomic, manifest)."""
    from safetensors.torch import save_file

    base = _base_tensors(base_dir)
    merged = merge_state(base, adapter_dir)
    untied = HEAD in merged and HEAD not in base

    def write(tmp: Path) -> None:
        for f in base_dir.iterdir():
            skip = f.suffix == ".safetensors" or f.name in (MANIFEST_NAME, _INDEX)
            if f.is_file() and not skip:
                shutil.copy2(f, tmp / f.name)
        save_file(merged, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if untied:
            config = json.loads((tmp / "config.json").read_text())
            config["tie_word_embeddings"] = False
            (tmp / "config.json").write_text(json.dumps(config, indent=2))

    return write_weights_dir(out, write, overwrite=overwrite)


_INDEX = "model.safetensors.index.json"  # the base's shard index: one file now

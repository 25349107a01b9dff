"""LoRA adapters on the CPU engine's model: read a PEFT directory, add B(A x) per row.

An adapter is PEFT's layout, read directly (safetensors + json, no peft at
run time): `adapter_config.json` and `adapter_model.safetensors` with
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r] for each target linear layer.

How it is applied: one forward hook on every linear layer some loaded adapter
targets adds `scaling * B_i (A_i x)` to the rows of the batch that use
adapter i, grouped by adapter (one pair of matmuls per adapter present, not
per row). So one batch mixes the base model and up to
`--max-loras-per-batch` adapters, as SGLang's segmented LoRA kernels do,
and the base weights are never touched: loading and unloading an adapter
costs nothing for the requests of the others. The alternative, merging
`W + s B A` per adapter and grouping requests by adapter, would run one
forward per adapter in a mixed batch and copy the whole layer at each
switch. Only the scheduler thread calls in here (`set_rows` before each
forward), so nothing needs a lock.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.engine.core.lora import AdapterConfig, LoraError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass
class Adapter:
    """One loaded adapter: (A [r, in], B [out, r]) per module name of the base model."""

    config: AdapterConfig
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def scaling(self) -> float:
        return self.config.scaling


def read_config(path: str, base_vocab_size: int) -> AdapterConfig:
    """`LoRAConfig(path)`: adapter_config.json, and added_tokens.json's ids past the vocab.

    A path that is no directory is, for SGLang, a Hugging Face repo id to
    download; with no hub here it fails as the hub's id check does for a path.
    """
    p = Path(path)
    if not p.is_dir():
        raise LoraError(
            "Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
            f"'{path}'. Use `repo_type` argument if needed."
        )
    try:
        doc = json.loads((p / CONFIG).read_text())
    except FileNotFoundError as e:
        raise LoraError(f"[Errno 2] No such file or directory: '{p / CONFIG}'") from e
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(str(e)) from e
    added = 0
    tokens = p / "added_tokens.json"
    if tokens.exists():
        try:
            ids = json.loads(tokens.read_text()).values()
            added = sum(1 for i in ids if isinstance(i, int) and i >= base_vocab_size)
        except (OSError, json.JSONDecodeError, AttributeError):
            log.warning("Failed to parse added_tokens.json of %s", path)
    try:
        config = AdapterConfig.from_json(doc, added)
    except KeyError as e:
        raise LoraError(repr(e)) from e
    except (TypeError, ValueError) as e:
        raise LoraError(str(e)) from e
    if config.use_rslora:
        log.warning("adapter %s sets use_rslora; SGLang (and this engine) scale by alpha / r", path)
    return config


def read_weights(path: str, config: AdapterConfig, model: Any) -> Adapter:
    """The adapter's tensors, checked against the model's linear layers (float32)."""
    import torch
    from safetensors.torch import load_file

    p = Path(path)
    files = [p / "adapter_model.safetensors"] if (p / "adapter_model.safetensors").exists() else []
    files = files or sorted(p.glob("*.safetensors"))
    if not files:
        raise LoraError(f"No adapter_model.safetensors found in {path}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for f in files:
        for key, tensor in load_file(str(f)).items():
            m = _KEY.match(key)
            if m is None:
                raise LoraError(f"unsupported tensor {key} in {f.name} (only linear LoRA layers)")
            pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    modules = dict(model.named_modules())
    layers = {}
    for name, ab in pairs.items():
        layer = modules.get(name)
        if not isinstance(layer, torch.nn.Linear) or set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {path} targets {name}, not a linear layer of the model")
        a, b = ab["A"].float(), ab["B"].float()
        want_a, want_b = (config.r, layer.in_features), (layer.out_features, config.r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraError(
                f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                f"expected {want_a} / {want_b}"
            )
        layers[name] = (a.contiguous(), b.contiguous())
    return Adapter(config, layers)


class LoraLayers:
    """The adapters loaded on one model and the hooks that apply them per batch row."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}  # by lora_id
        self._hooks: dict[str, Any] = {}  # module name -> hook handle
        self._rows: list[tuple[Adapter, Any]] = []  # (adapter, row indices | None = all)

    def add(self, lora_id: str, adapter: Adapter) -> None:
        self.adapters[lora_id] = adapter
        modules = dict(self.model.named_modules())
        for name in adapter.layers:
            if name not in self._hooks:
                self._hooks[name] = modules[name].register_forward_hook(self._hook(name))

    def remove(self, lora_id: str) -> None:
        self.adapters.pop(lora_id, None)
        wanted = {n for a in self.adapters.values() for n in a.layers}
        for name in [n for n in self._hooks if n not in wanted]:
            self._hooks.pop(name).remove()

    def set_rows(self, lora_ids: list[str | None]) -> None:
        """Which adapter each row of the next forward uses (None: the base model)."""
        import torch

        groups: dict[str, list[int]] = {}
        for row, lora_id in enumerate(lora_ids):
            if lora_id is not None:
                groups.setdefault(lora_id, []).append(row)
        self._rows = [
            (
                self.adapters[i],
                None if len(rows) == len(lora_ids) else torch.tensor(rows, dtype=torch.long),
            )
            for i, rows in groups.items()
        ]

    def _hook(self, name: str) -> Any:
        def add_lora(module: Any, inputs: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]  # [B, T, in]
            for adapter, rows in self._rows:
                ab = adapter.layers.get(name)
                if ab is None:
                    continue
                a, b = ab
                if rows is None:
                    out = out + adapter.scaling * ((x @ a.T) @ b.T)
                else:
                    delta = adapter.scaling * ((x[rows] @ a.T) @ b.T)
                    out = out.index_add(0, rows, delta)
            return out

        return add_lora

"""The torch adapter: one Hugging Face causal LM, prefill and decode on a KVBatch.

Only the scheduler thread calls into a ModelRunner, so the model, its cache
and its weights need no locks. Weight updates load a whole directory's
safetensors into memory, check every name and shape against the live model,
and only then copy in place: a bad directory leaves the old weights serving.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.engine.core.kvbatch import (
    KVBatch,
    left_pad_ids,
    positions,
    right_align,
    zero_padding,
)
from services.engine.core.sequence import UpdateRefused
from services.engine.lora_weights import LoraLayers

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

log = logging.getLogger(__name__)

MANIFEST = "flywheel-manifest.json"


class WeightsLoadError(UpdateRefused):
    """A weights directory was refused; `path` names it. The old weights keep serving."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"cannot load weights from {path}: {reason}")
        self.path = str(path)
        self.reason = reason


def eos_ids(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def generation_config(model_dir: Path) -> dict[str, Any] | None:
    """The model's generation_config.json, or None where there is none or it is no JSON
    object (SGLang's get_generation_config: transformers' OSError becomes None)."""
    try:
        doc = json.loads((model_dir / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def verify_directory(path: Path, check: str = "sha256") -> None:
    """Refuse a missing directory, and check it against its manifest when it has one.

    `check` is the engine's `weights_check`: "sha256" re-hashes every file,
    "sizes" checks names and sizes only. The manifest format belongs to
    `services.weights` (written by the trainer); this only calls its
    `verify_weights_dir`.
    """
    if not path.is_dir():
        raise WeightsLoadError(path, "not a directory")
    if (path / MANIFEST).exists():
        from services.weights import WeightsError, verify_weights_dir

        try:
            verify_weights_dir(path, sizes_only=check == "sizes")
        except WeightsError as e:
            raise WeightsLoadError(path, f"manifest check failed: {e}") from e


def cache_kwarg(model: Any) -> str:
    """The name a model's forward takes its KV cache by: `cache` from the transformers that
    renamed it (5.x; `past_key_values` warns there and goes in 5.40), `past_key_values` in
    the releases before. Read from the forward's signature (the deprecation decorator keeps
    it), so the engine passes the name the installed release expects and warns about none."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [B, H, T, D] of every layer of a transformers DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


class ModelRunner:
    """Owns the model; runs batched prefill and decode steps (scheduler thread only)."""

    def __init__(
        self, model_dir: str | Path, num_threads: int = 0, weights_check: str = "sha256"
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.model_dir = Path(model_dir)
        self.weights_check = weights_check  # what load_weights checks (EngineSettings)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.context_len = int(getattr(config, "max_position_embeddings", 2048))
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self._cache: Any = None  # DynamicCache mirroring the scheduler's KVBatch
        self._cache_kwarg = cache_kwarg(self.model)
        self.lora = LoraLayers(self.model)  # adapters loaded by /load_lora_adapter

    # ---- forward passes -------------------------------------------------------------

    def prefill(
        self, seqs: list[list[int]], lora_ids: list[str | None] | None = None
    ) -> tuple[torch.Tensor, KVBatch]:
        """Run prompts (right-aligned); return last-position logits [B, V] and their cache.
        `lora_ids`: each row's adapter (None: the base model)."""
        import torch
        from transformers import DynamicCache

        self.lora.set_rows(lora_ids or [None] * len(seqs))
        ids, mask = left_pad_ids(seqs, self.pad_id)  # [B, L], [B, L]
        cache = DynamicCache()
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions(mask),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
        layers = _cache_tensors(cache)
        lengths = mask.sum(-1)
        kv = zero_padding(KVBatch(layers, mask, lengths))
        return out.logits[:, -1, :].float(), kv  # [B, V]

    def extend(
        self, past: KVBatch, suffixes: list[list[int]], lora_ids: list[str | None] | None = None
    ) -> tuple[torch.Tensor, KVBatch]:
        """Run each row's `suffixes[r]` on top of its cached prefix `past` (row r's first
        `past.lengths[r]` positions, right-aligned); return last-position logits [B, V]
        and the whole rows' cache, right-aligned (`prefill` when no row has a prefix).

        The suffixes are left-padded after the past, so a row's columns read
        [pad | prefix | pad | suffix]: the mask says which are real and the position ids
        continue each row's prefix, which is all attention and rotary read."""
        import torch
        from transformers import DynamicCache

        self.lora.set_rows(lora_ids or [None] * len(suffixes))
        ids, smask = left_pad_ids(suffixes, self.pad_id)  # [B, S], [B, S]
        mask = torch.cat([past.mask, smask], dim=1)  # [B, P + S]
        pos = past.lengths[:, None] + positions(smask)  # [B, S]
        cache = DynamicCache(ddp_cache_data=past.layers)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
        kv = right_align(_cache_tensors(cache), mask)
        return out.logits[:, -1, :].float(), kv  # [B, V]

    def prompt_logprobs(
        self, ids: list[int], start: int, lora_id: str | None = None
    ) -> list[float]:
        """log p(ids[i] | ids[:i]) for i in start + 1 .. len(ids) - 1, from the raw logits of
        one forward over `ids` (SGLang's input logprobs: no temperature, no top-p/top-k)."""
        import torch

        self.lora.set_rows([lora_id])
        x = torch.tensor([ids], dtype=torch.long)  # [1, L]
        with torch.inference_mode():
            logits = self.model(input_ids=x, use_cache=False).logits[0, start:-1].float()
        logp = torch.log_softmax(logits, dim=-1)  # [L - 1 - start, V]
        targets = x[0, start + 1 :]  # [L - 1 - start]
        return logp.gather(-1, targets[:, None])[:, 0].tolist()

    def invalidate(self) -> None:
        """The KVBatch changed shape (join/select): rebuild the model cache on next decode."""
        self._cache = None

    def decode(
        self, kv: KVBatch, tokens: torch.Tensor, lora_ids: list[str | None] | None = None
    ) -> torch.Tensor:
        """Append `tokens` [B] to every row; return next-token logits [B, V]. Mutates kv."""
        import torch
        from transformers import DynamicCache

        self.lora.set_rows(lora_ids or [None] * kv.batch)
        if self._cache is None:
            self._cache = DynamicCache(ddp_cache_data=kv.layers)
        mask = torch.cat([kv.mask, kv.mask.new_ones((kv.batch, 1))], dim=1)  # [B, T+1]
        with torch.inference_mode():
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=kv.lengths[:, None],
                use_cache=True,
                **{self._cache_kwarg: self._cache},
            )
        kv.layers = _cache_tensors(self._cache)
        kv.mask = mask
        kv.lengths = kv.lengths + 1
        return out.logits[:, -1, :].float()  # [B, V]

    # ---- weights --------------------------------------------------------------------

    def disk_loader(self, path: str) -> Callable[[], str]:
        """`/update_weights_from_disk`'s load (for `Scheduler.update_weights`)."""

        def load() -> str:
            try:
                self.load_weights(path)
            except WeightsLoadError:
                raise
            except Exception as e:  # any failure must answer the caller; weights unchanged
                log.exception("weight update from %s failed", path)
                raise UpdateRefused(f"Failed to update weights: {e}.") from e
            return "Succeeded to update model weights."

        return load

    def load_weights(self, path: str | Path) -> None:
        """Replace the weights with those in `path`; on WeightsLoadError nothing changed."""
        import torch
        from safetensors.torch import load_file

        p = Path(path)
        verify_directory(p, self.weights_check)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise WeightsLoadError(p, "no *.safetensors files")
        loaded: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                loaded.update(load_file(str(f)))
            except (OSError, ValueError, RuntimeError) as e:
                raise WeightsLoadError(p, f"{f.name} is unreadable: {e}") from e
        live = self.model.state_dict()
        unknown = sorted(set(loaded) - set(live))
        if unknown:
            raise WeightsLoadError(p, f"unexpected tensors: {unknown[:5]}")
        tied = (
            {"lm_head.weight"}
            if getattr(self.model.config, "tie_word_embeddings", False)
            else set()
        )
        missing = sorted(set(live) - set(loaded) - tied)
        if missing:
            raise WeightsLoadError(p, f"missing tensors: {missing[:5]}")
        for name, tensor in loaded.items():
            if tuple(tensor.shape) != tuple(live[name].shape):
                raise WeightsLoadError(
                    p,
                    f"{name} has shape {tuple(tensor.shape)}, model has {tuple(live[name].shape)}",
                )
        with torch.no_grad():
            for name, tensor in loaded.items():
                # copy_ converts the dtype as it copies (bf16 published, float32 served): a
                # `.to()` first wrote a whole float32 copy to copy again, 0.10 vs 0.02 CPU s
                # for SmolLM2-135M (bench/results_sync.md, "What a version costs")
                live[name].copy_(tensor)
        self.model_dir = p
        self._cache = None
        log.info("loaded weights from %s (%d tensors)", p, len(loaded))

    def load_named(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy received tensors in, in order, as SGLang's `model.load_weights` does: a bad
        one stops there, leaving the weights partly updated (its message says so)."""
        import torch

        live = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in live:
                    log.warning("Parameter %s not found in params_dict", name)
                    continue
                if tuple(tensor.shape) != tuple(live[name].shape):
                    raise ValueError(
                        f"Attempted to load weight ({tensor.size()}) "
                        f"into parameter ({live[name].size()})"
                    )
                live[name].copy_(tensor.to(live[name].dtype))
        self._cache = None

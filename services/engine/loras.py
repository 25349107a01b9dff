"""The CPU engine's LoRA adapters: what /load_lora_adapter, /unload_lora_adapter and
/generate's `lora_path` (services/engine/lora_api.py, generate.py) act on.

`Loras` is what SGLang splits between its tokenizer manager and its
scheduler (read from `managers/tokenizer_manager.py`,
`tokenizer_communicator_mixin.py` / `tokenizer_control_mixin.py`,
`lora/lora_registry.py`, `lora/lora_manager.py`, 0.5.4-0.5.23):

- the registry (names a request may use, in LRU order), the adapters
  loaded in the model (`loaded`, by load id), and every name ever loaded
  with its path (0.5.6+: a request naming an unloaded one loads it again);
- one LoRA update at a time (`lora_update_lock`); a load reads and checks
  the directory off the event loop, then the scheduler thread installs it
  between two steps; an unload first unregisters the name (new requests
  are refused), waits until no request uses the adapter, then removes it;
- requests count their adapter's use from admission to answer
  (`acquire`/`release`).

Answers are `LoRAUpdateOutput` as SGLang serializes it (`rid`,
`http_worker_ipc`, `success`, `error_message`, `loaded_adapters` name ->
path), 200 on success and 400 otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from services.engine.core.lora import (
    NOT_ENABLED,
    AdapterRef,
    LoraError,
    LoraLimits,
    generate_not_enabled,
    keys_repr,
    normalized_targets,
    validate_new_adapter,
)
from services.engine.lora_weights import Adapter, read_config, read_weights

if TYPE_CHECKING:
    from services.engine.scheduler import Scheduler
    from services.engine_api.sglang_api import Capabilities
    from services.engine_api.sglang_launcher import LoraServing

log = logging.getLogger(__name__)


def limits_of(serving: LoraServing | None) -> LoraLimits | None:
    if serving is None:
        return None
    targets = frozenset(normalized_targets(serving.target_modules))
    return LoraLimits(serving.max_rank, targets, serving.max_per_batch)


class Loras:
    """The engine's adapters: registry, loads and unloads, use counts (event loop side)."""

    def __init__(
        self,
        limits: LoraLimits | None,
        caps: Capabilities,
        scheduler: Scheduler,
        model: Any,
        vocab_size: int,
    ) -> None:
        self.limits = limits  # None: LoRA is off (no --enable-lora)
        self.caps = caps
        self.scheduler = scheduler
        self.model = model
        self.vocab_size = vocab_size
        self.registry: OrderedDict[str, AdapterRef] = OrderedDict()
        self.loaded: dict[str, AdapterRef] = {}  # lora_id -> ref, in load order
        self.ever_loaded: dict[str, AdapterRef] = {}  # SGLang's lora_ref_cache
        self.in_use: dict[str, int] = {}  # lora_id -> requests using it
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        if limits is not None:
            scheduler.max_loras_per_batch = limits.max_per_batch

    def lock(self) -> asyncio.Lock:
        """`lora_update_lock`, for the running loop (tests serve one state from several)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    def answer(self, ok: bool, message: str | None, backend: bool = True) -> dict[str, Any]:
        """`LoRAUpdateOutput`: `loaded_adapters` only when the scheduler answered."""
        adapters = {r.name: r.path for r in self.loaded.values()} if backend else None
        return {"rid": None, "http_worker_ipc": None, "success": ok,
                "error_message": message, "loaded_adapters": adapters}  # fmt: skip

    # ── load / unload ─────────────────────────────────────────────────────────
    async def load(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        if self.limits is None:
            return self.answer(False, NOT_ENABLED, backend=False)
        async with self.lock():
            ref = AdapterRef(name, path, pinned)
            try:
                adapter = await asyncio.to_thread(self._read, ref, self.limits)
                await asyncio.wrap_future(self.scheduler.run(lambda: self._install(ref, adapter)))
            except Exception as e:  # noqa: BLE001 -- SGLang answers any load failure as its text
                log.warning("LoRA adapter %s from %s refused: %s", name, path, e)
                return self.answer(False, str(e))
            self.loaded[ref.lora_id] = ref
            self.registry[name] = ref
            self.ever_loaded[name] = ref
            self.in_use[ref.lora_id] = 0
            log.info("LoRA adapter %s loaded from %s", name, path)
            return self.answer(True, "")

    def _read(self, ref: AdapterRef, limits: LoraLimits) -> Adapter:
        """`LoRAManager._load_lora_adapter` up to the weights (a worker thread)."""
        config = read_config(ref.path, self.vocab_size)
        pinned = sum(1 for r in self.loaded.values() if r.pinned)
        validate_new_adapter(config, ref, self.loaded.values(), limits, pinned)
        return read_weights(ref.path, config, self.model)

    def _install(self, ref: AdapterRef, adapter: Adapter) -> None:
        """On the scheduler thread, between two forwards."""
        self.scheduler.runner.lora.add(ref.lora_id, adapter)
        if ref.pinned:
            self.scheduler.pinned_loras.add(ref.lora_id)

    def _remove(self, lora_id: str) -> None:
        self.scheduler.runner.lora.remove(lora_id)
        self.scheduler.pinned_loras.discard(lora_id)

    async def unload(self, name: str) -> dict[str, Any]:
        if self.limits is None:
            return self.answer(False, NOT_ENABLED, backend=False)
        async with self.lock():
            ref = self.registry.get(name)
            if ref is None:
                keys = keys_repr(self.registry, self.caps.lora_registry_keys)
                message = f"LoRA with name {name} does not exist. Loaded LoRAs: {keys}"
                return self.answer(False, message, backend=False)
            del self.registry[name]  # new requests naming it are refused from now on
            while self.in_use.get(ref.lora_id, 0) > 0:  # SGLang's wait_for_unload
                await asyncio.sleep(0.01)
            await asyncio.wrap_future(self.scheduler.run(lambda: self._remove(ref.lora_id)))
            self.loaded.pop(ref.lora_id, None)
            self.in_use.pop(ref.lora_id, None)
            log.info("LoRA adapter %s unloaded", name)
            return self.answer(True, "")

    # ── requests ──────────────────────────────────────────────────────────────
    async def acquire(self, names: list[str | None], raw: Any) -> list[str | None]:
        """The load ids of each sequence's adapter (`_validate_and_resolve_lora`, then
        `LoRARegistry.acquire`); LoraError with SGLang's text. `raw`: the request's
        `lora_path` as given (what the LoRA-off message names)."""
        if not any(names):
            return [None] * len(names)
        if self.limits is None:
            if not self.caps.lora_refused_when_disabled:
                return [None] * len(names)  # before 0.5.10 the field was ignored
            first = raw if isinstance(raw, str) else next((a for a in raw if a), None)
            raise LoraError(generate_not_enabled(first))
        if self.caps.lora_reloads_unloaded:
            await self._reload_unloaded({n for n in names if n is not None})
        ids: list[str | None] = []
        for name in names:
            ref = None if name is None else self.registry.get(name)
            if name is not None and ref is None:
                raise LoraError(
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {keys_repr(self.registry, self.caps.lora_registry_keys)}."
                )
            if ref is not None and self.caps.lora_registry_keys == "odict_keys":
                self.registry.move_to_end(ref.name)  # LRU order from 0.5.6
            ids.append(None if ref is None else ref.lora_id)
        for lora_id in ids:
            if lora_id is not None:
                self.in_use[lora_id] = self.in_use.get(lora_id, 0) + 1
        return ids

    async def _reload_unloaded(self, names: set[str]) -> None:
        """0.5.6+: names not registered are loaded again if they ever were."""
        for name in sorted(names - set(self.registry)):
            cached = self.ever_loaded.get(name)
            if cached is None:
                raise LoraError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {keys_repr(self.ever_loaded, 'dict_keys')}."
                )
            log.info("Reloading evicted adapter: %s", name)
            result = await self.load(cached.name, cached.path, cached.pinned)
            message = result["error_message"] or ""
            if not result["success"] and "already loaded" not in message:
                raise LoraError(f"Failed to implicitly load LoRA adapter {name}: {message}")

    def release(self, ids: list[str | None]) -> None:
        for lora_id in ids:
            if lora_id is not None and lora_id in self.in_use:
                self.in_use[lora_id] -= 1

    def model_cards(self, parent: str, created: int) -> list[dict[str, Any]]:
        """`/v1/models` entries of the registered adapters (0.5.5+)."""
        if self.limits is None or not self.caps.lists_lora_models:
            return []
        return [
            {
                "id": r.name,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": r.path,
                "parent": parent,
                "max_model_len": None,
            }
            for r in self.registry.values()
        ]

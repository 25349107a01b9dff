"""How an engine takes a LoRA adapter version (`WeightsPublished.format == "peft-lora"`).

A transport says where an engine finds a version (its `WeightsSource`:
the shared directory, or the engine's own copy); for an adapter the
directory holds PEFT's two files instead of a model, and what sync asks
the engine differs. Two ways, `[sync] lora_mode`:

- **adapter** (`AdapterLoad`): `/load_lora_adapter` under the version's
  name (`proto.weight_version.adapter_name`, `v000012`) beside the base
  model and the adapters already loaded: nothing is paused, running
  requests keep the adapter they started with, and the rollout worker
  sends the newest name as `lora_path`. Superseded adapters are
  `unload_superseded`: SGLang answers an unload once no running request
  uses the adapter any more (the worker switches to the newest at its next
  task), so the staleness bound is the one of full weights.
- **merged** (`MergedLoad`): for engines that cannot serve adapters; the
  adapter is folded into its base (merge.py) into `<path>-merged` and
  loaded with `/update_weights_from_disk` like any whole version. The
  merge reads the base the adapter names and writes beside the engine's
  copy: sync must see both paths (the same host, or shared storage). A
  merged copy is a whole model: those two versions older than the newest
  are deleted when a newer one is made (the transports' pruning knows only
  version directories).

Either wraps the transport's source, so `engine_path` (has the engine a
copy yet?) stays the transport's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proto.weight_version import adapter_name, parse_adapter_name

if TYPE_CHECKING:
    from services.engine_api.engine_client import EngineClient, UpdateResult
    from services.weights.base import WeightsSource

log = logging.getLogger(__name__)

ALREADY_LOADED = "already loaded"  # SGLang's refusal of a name in use (a retried load)


@dataclass(frozen=True)
class AdapterLoad:
    """Load the version as the named adapter `v<version>` (`/load_lora_adapter`)."""

    inner: WeightsSource

    def engine_path(self, engine_dir: str | None, downloaded: int | None) -> str | None:
        return self.inner.engine_path(engine_dir, downloaded)

    async def load(
        self, client: EngineClient, path: str, version: int, update_mode: str
    ) -> UpdateResult:
        from services.engine_api.engine_client import EngineHTTPError, UpdateResult

        try:
            await client.load_lora_adapter(adapter_name(version), path)
        except EngineHTTPError as e:
            # A load that timed out on our side may have finished on the engine: the name
            # is then loaded already, with this version's files (names are versions).
            if e.status != 400 or ALREADY_LOADED not in e.message:
                raise
        return UpdateResult(True, f"adapter {adapter_name(version)} loaded", 0)


@dataclass(frozen=True)
class MergedLoad:
    """Merge the adapter into its base beside `path`, then load that whole."""

    inner: WeightsSource

    def engine_path(self, engine_dir: str | None, downloaded: int | None) -> str | None:
        return self.inner.engine_path(engine_dir, downloaded)

    async def load(
        self, client: EngineClient, path: str, version: int, update_mode: str
    ) -> UpdateResult:
        from services.engine_api.engine_client import UpdateResult
        from services.weights.adapter import AdapterError

        try:
            merged = await asyncio.to_thread(merged_copy, Path(path))
        except (AdapterError, OSError) as e:  # sync counts it as a failed update
            return UpdateResult(False, f"cannot merge {path}: {e}", 0)
        return await client.update_weights_from_disk(str(merged), version, update_mode=update_mode)


def merged_copy(adapter_dir: Path) -> Path:
    """`<adapter_dir>-merged`: the adapter's base with it merged in (made once). The base
    is the directory the adapter names (the trainer writes its model directory's path)."""
    from services.weights.adapter import AdapterError, read_config
    from services.weights.merge import merge_into

    out = adapter_dir.with_name(adapter_dir.name + "-merged")
    if not out.is_dir():
        base = Path(read_config(adapter_dir).base)
        if not base.is_dir():
            raise AdapterError(f"{adapter_dir}: its base {base} is not a directory here",
                               path=adapter_dir)  # fmt: skip
        merge_into(base, adapter_dir, out)
        _drop_older_merged(adapter_dir)
    return out


def _drop_older_merged(adapter_dir: Path) -> None:
    """Delete `v<k>-merged` beside `adapter_dir` (version n) for k < n - 1: the previous one
    may still be loading on another engine, older ones are served by none."""
    import shutil

    from proto.weight_version import parse_name

    n = parse_name(adapter_dir.name)
    if n is None:
        return
    for p in adapter_dir.parent.glob("v*-merged"):
        k = parse_name(p.name.removesuffix("-merged"))
        if k is not None and k < n - 1:
            shutil.rmtree(p, ignore_errors=True)


def adapter_versions(models: Any) -> set[int]:
    """The versions of the LoRA adapters Flywheel loaded on an engine, from its `/v1/models`
    (SGLang >= 0.5.5 lists each loaded adapter as a model with a `parent`)."""
    data = models.get("data") if isinstance(models, dict) else None
    names = [m.get("id") for m in data or [] if isinstance(m, dict) and m.get("parent")]
    return {v for v in map(parse_adapter_name, (str(n) for n in names)) if v is not None}


async def loaded_adapters(client: EngineClient) -> set[int]:
    """The Flywheel adapters loaded on the engine behind `client` (its /v1/models)."""
    return adapter_versions(await client.request("GET", "/v1/models"))


def superseded(loaded: set[int], newest: int, keep: int) -> list[int]:
    """The adapter versions to unload once `newest` is loaded: all but the `keep` newest
    (the newest and the ones the worker may still have picked just before it came)."""
    kept = sorted(v for v in loaded if v <= newest)[-keep:]
    return sorted(v for v in loaded if v not in kept)


async def unload_superseded(
    client: EngineClient, loaded: set[int], newest: int, keep: int
) -> set[int]:
    """Unload the superseded adapters (each answered once no request uses it); the
    versions still loaded. An adapter the engine no longer has counts as unloaded."""
    from services.engine_api.engine_client import EngineHTTPError

    left = set(loaded)
    for v in superseded(loaded, newest, keep):
        try:
            await client.unload_lora_adapter(adapter_name(v))
        except EngineHTTPError as e:
            if e.status != 400:
                raise
            log.info("sync: adapter %s was not loaded: %s", adapter_name(v), e.message)
        left.discard(v)
    return left

"""The torch.distributed transport: sync broadcasts each version to its engines' groups.

`[trainer] weights_transport = "distributed"`. The trainer saves a version
as always (a shared directory; late joiners and restarts need it anyway)
and announces `dist:///<root>/<run>/v000012`. Sync, which already knows the
engines (heartbeats) and holds every update's rules (pause modes, retries),
is **rank 0**: per engine it forms a two-rank group with SGLang's
`/init_weights_update_group` (sync hosts the store on a free port of
`dist_address`), and per update it reads the version's safetensors and
broadcasts them while the engine's `/update_weights_from_distributed`
(between `/begin_weight_update` and `/end_weight_update` from 0.5.21)
receives them. One group per engine keeps sync's rule that engines update
independently: an engine that joins mid-run simply gets its own group at its
first update, one that fails has its group dropped and re-formed at its
retry, and no collective waits for a slow engine.

Limits, said plainly: rank 0 reads the version from disk and sends it once
per engine (N engines: N times the model from sync, as the full disk and
NATS transports cost), so this is SGLang's protocol end to end, not yet
fleet-scale broadcast; that needs one group over all engines (re-formed on
every membership change) and the trainer's rank 0 as the sender from GPU
memory (NCCL). The engines must reach `dist_address` on any port. An engine
that refuses mid-way leaves sync's side of the collective waiting for the
group's timeout (60 s) before the update counts as failed and is retried.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlparse

from proto.weight_version import to_engine
from services.weights.base import BadWeightsUri, Sent, Transfer, Wiring
from services.weights.disk import shared_path

if TYPE_CHECKING:
    from proto.messages import WeightsPublished
    from services.engine_api.engine_client import EngineClient, UpdateResult

log = logging.getLogger(__name__)

SCHEME = "dist"
GROUP = "flywheel_weights"


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def read_tensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


class Groups:
    """Sync's rank-0 side: one weights-update group per engine URL."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.groups: dict[str, tuple[Any, str]] = {}  # engine URL -> (group, its name)
        self.formed = 0

    async def group(self, client: EngineClient) -> tuple[Any, str]:
        from services.weights.distgroup import join_group

        if client.url in self.groups:
            return self.groups[client.url]
        port = free_port(self.address)
        self.formed += 1  # a name per group: one process cannot hold two of one name
        name = f"{GROUP}_{self.formed}"
        body = {
            "master_address": self.address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": name,
            "backend": "gloo",
        }
        mine = asyncio.create_task(
            asyncio.to_thread(join_group, self.address, port, 0, 2, name, "gloo", 60.0)
        )
        try:
            await client.request("POST", "/init_weights_update_group", body, retries=0)
        finally:
            pg = await mine  # the engine joined, or its refusal left us timing out alone
        self.groups[client.url] = (pg, name)
        return pg, name

    def drop(self, url: str) -> None:
        from services.weights.distgroup import destroy_group

        held = self.groups.pop(url, None)
        if held is not None:
            destroy_group(held[0])

    async def update(
        self, client: EngineClient, path: str, version: int, update_mode: str
    ) -> UpdateResult:
        from services.engine_api.engine_client import EngineError, UpdateResult
        from services.weights.distgroup import broadcast_tensors

        try:
            pg, name = await self.group(client)
            tensors = await asyncio.to_thread(read_tensors, Path(path))
            caps = await client.capabilities()
            session = caps.at_least(0, 5, 21)
            body = {
                "names": list(tensors),
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                "shapes": [list(t.shape) for t in tensors.values()],
                "group_name": name,
                "weight_version": to_engine(version),
                "abort_all_requests": update_mode == "abort",
                "flush_cache": bool(caps.flush_cache_for(update_mode)),
            }
            if session:
                await client.request("POST", "/begin_weight_update", {})
            try:
                out, _ = await asyncio.gather(
                    client.request("POST", "/update_weights_from_distributed", body),
                    asyncio.to_thread(broadcast_tensors, pg, list(tensors.values())),
                )
            finally:
                if session:
                    await client.request("POST", "/end_weight_update", {})
        except EngineError:
            self.drop(client.url)  # re-formed at the next attempt
            raise
        except Exception as e:  # a gloo timeout or a broken group: a failed update to retry
            self.drop(client.url)
            raise EngineError(f"distributed weights update failed: {e}", client.url) from e
        return UpdateResult(bool(out["success"]), str(out["message"]), 0)


@dataclass(frozen=True)
class Broadcast:
    """A version sync broadcasts from this shared directory to each engine's group."""

    path: str
    groups: Groups

    def engine_path(self, engine_dir: str | None, downloaded: int | None) -> str | None:
        return self.path

    async def load(
        self, client: EngineClient, path: str, version: int, update_mode: str
    ) -> UpdateResult:
        return await self.groups.update(client, path, version, update_mode)


class DistTransport:
    kind: ClassVar[str] = "distributed"
    scheme: ClassVar[str] = SCHEME

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.groups = Groups(wiring.dist_address)

    async def publish(self, version: int, directory: Path) -> Sent:
        return Sent(uri=f"{SCHEME}://{directory.resolve()}")

    def source(self, uri: str, version: int) -> Broadcast:
        if self.wiring.root is None:
            raise ValueError("the distributed weights transport needs the weights root")
        p = urlparse(uri)
        if p.scheme != SCHEME:
            raise BadWeightsUri(f"unsupported weights uri {uri!r}")
        return Broadcast(str(shared_path(Path(p.path).as_uri(), self.wiring.root)), self.groups)

    async def receive(
        self, msg: WeightsPublished, into: Path, newer_than: int | None
    ) -> Transfer | None:
        return None  # sync broadcasts straight into the engine

    async def cleanup(self, below: int) -> None:
        return None

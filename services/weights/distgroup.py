"""The weights-update process group both sides of SGLang's distributed protocol join.

SGLang's `/init_weights_update_group` makes every engine join a process
group of its own beside any default group (`init_custom_process_group` in
`sglang/srt/utils/common.py`): a TCP rendezvous at
`tcp://master_address:master_port` whose store rank 0 hosts, a
`PrefixStore(group_name, …)`, then a group of `world_size` ranks. Rank 0 is
the sender (the trainer's side); the engines are `rank_offset + tp_rank`.
`/update_weights_from_distributed` then receives one `broadcast(src=0)` per
named tensor, allocated from the request's names, dtypes and shapes. The
same function builds the group on both sides, so the engine and its sender
cannot disagree on how. torch is imported inside the functions.
"""

from __future__ import annotations

import datetime
from typing import Any

DEFAULT_TIMEOUT_S = 1800.0  # torch's default_pg_timeout, which SGLang uses


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Join (rank 0: host) the named group; blocks until all `world_size` ranks joined."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    init = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(init, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,  # type: ignore[arg-type]
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


def broadcast_tensors(pg: Any, tensors: list[Any]) -> None:
    """Rank 0: send each tensor in order (the receivers allocate them from the request)."""
    import torch.distributed as dist

    handles = [dist.broadcast(t.contiguous(), src=0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def receive_tensors(
    pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, Any]]:
    """A receiver: SGLang's `receive_weights_from_distributed` (one broadcast per name)."""
    import torch
    import torch.distributed as dist

    weights: list[tuple[str, Any]] = []
    handles = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=False):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(dist.broadcast(t, src=0, group=pg, async_op=True))
        weights.append((name, t))
    for h in handles:
        h.wait()
    return weights

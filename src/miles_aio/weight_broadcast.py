"""Weight updates by broadcast: the torch.distributed protocol of SGLang's `/init_weights_update_group` and
`/update_weights_from_distributed`, shared by both ends (the trainer's rank 0 sends, engines receive).

The wire protocol is SGLang's (`sglang/srt/utils/common.py:init_custom_process_group`, and
`model_runner_components/weight_updater.py`): the trainer's rank 0 and the engine ranks
(`rank_offset + tp_rank`) rendezvous at `tcp://master_address:master_port`, wrap the store in
`PrefixStore(group_name, ...)` and build a *non-default* process group, so it can coexist with the
trainer's own default group. Each update is then one `broadcast(src=0)` per tensor, in the order of the
request's `names`. Trainer code reaches an engine, this one or real SGLang, by calling
`init_custom_process_group(..., rank=0)` and `broadcast_weights`.

A neutral module: the trainer imports it without importing the engine, and the engine without the
trainer. All functions block (rendezvous waits for every rank) and must run off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Final

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous

__all__ = ["DEFAULT_TIMEOUT", "broadcast_weights", "init_custom_process_group", "receive_weights"]

DEFAULT_TIMEOUT: Final = timedelta(minutes=10)
"""Rendezvous and collective timeout: how long a rank waits for the others (torch's default: 30 min)."""


def init_custom_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> dist.ProcessGroup:
    """Join (rank 0: host) a named process group that is not the default one, exactly as SGLang does.

    Blocks until all `world_size` ranks have joined or `timeout` passes.
    """
    if not group_name:
        raise ValueError("group_name must not be empty")
    # Same sequence as SGLang/OpenRLHF: rendezvous → PrefixStore(group_name) → _new_process_group_helper.
    # The helper is private torch API, but it is the only way to build a second "world" in one process, and
    # the store layout must match the peer's byte for byte or the rendezvous hangs.
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = c10d.PrefixStore(group_name, store)
    pg: dist.ProcessGroup
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        prefixed,
        group_name=c10d.GroupName(group_name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], *, group: dist.ProcessGroup) -> None:
    """Rank 0 (the trainer): send each tensor, in order, to every engine in `group`."""
    handles = [dist.broadcast(t.contiguous(), src=0, group=group, async_op=True) for _, t in named_tensors]
    for handle in handles:
        if handle is not None:
            handle.wait()


def receive_weights(
    *,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """Engine side: receive one broadcast per (shape, dtype), in order, from rank 0."""
    out = [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in out]
    for handle in handles:
        if handle is not None:
            handle.wait()
    return out


def destroy_process_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)

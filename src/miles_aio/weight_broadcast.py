"""Weight updates by broadcast: the torch.distributed protocol of SGLang's `/init_weights_update_group` and
`/update_weights_from_distributed`, shared by both ends (the trainer's rank 0 sends, engines receive).

The wire protocol is SGLang's (`sglang/srt/utils/common.py:init_custom_process_group`, and
`model_runner_components/weight_updater.py`): the trainer's rank 0 and the engine ranks
(`rank_offset + tp_rank`) rendezvous at `tcp://master_address:master_port`, wrap the store in
`PrefixStore(group_name, ...)` and build a *non-default* process group, so it can coexist with the
trainer's own default group. Each update is then one `broadcast(src=0)` per tensor, in the order of the
request's `names`. Trainer code reaches an engine, this one or real SGLang, by calling
`init_custom_process_group(..., rank=0)` and `broadcast_weights`.

With `load_format: "flattened_bucket"` the whole update is ONE broadcast instead: SGLang's
`FlattenedTensorBucket` (`sglang/srt/weight_sync/tensor_bucket.py`), a uint8 tensor holding each tensor's
bytes (`t.flatten().view(torch.uint8)`) back to back in `names` order, no padding, whatever the dtypes;
the receiver refuses a tensor whose byte offset is not a multiple of its dtype's size (it is read back as
a view). `broadcast_flattened_bucket` / `receive_flattened_bucket` are the two ends.

A neutral module: the trainer imports it without importing the engine, and the engine without the
trainer. All functions block (rendezvous waits for every rank) and must run off the event loop.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store, TCPStore  # re-exported untyped by torch.distributed
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous

__all__ = [
    "DEFAULT_TIMEOUT",
    "BucketEntry",
    "broadcast_flattened_bucket",
    "broadcast_weights",
    "bucket_layout",
    "flatten_bucket",
    "init_custom_process_group",
    "is_loopback",
    "loopback_store",
    "receive_flattened_bucket",
    "receive_weights",
]

DEFAULT_TIMEOUT: Final = timedelta(minutes=10)
"""Rendezvous and collective timeout: how long a rank waits for the others (torch's default: 30 min)."""


def is_loopback(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def loopback_store(host: str, port: int, world_size: int, *, is_master: bool, timeout: timedelta) -> TCPStore:
    """A TCPStore at host:port whose server (the master) listens on that address alone: torch binds a
    store's server to every interface whatever the host, and a store takes unauthenticated writes, but
    it serves on a socket it is handed (`master_listen_fd`). Clients connect as to any TCPStore."""
    host = "127.0.0.1" if host == "localhost" else host
    listen_fd = None
    if is_master:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(world_size, 128))
        listen_fd = sock.detach()  # the store's server owns it from here
    return TCPStore(host, port, world_size, is_master, timeout, master_listen_fd=listen_fd)


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
    store: Store
    if is_loopback(master_address):
        # Everything is on this machine: keep the group off the network. The store's server (rank 0)
        # listens on the loopback address alone, and gloo's pair sockets use the loopback interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = loopback_store(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    else:
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


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """One tensor's place in a flattened bucket (SGLang's `FlattenedTensorMetadata`): bytes [start, end)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int


def flatten_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[BucketEntry]]:
    """SGLang's `FlattenedTensorBucket(named_tensors)`: one uint8 tensor, each tensor's bytes in order."""
    parts: list[torch.Tensor] = []
    entries: list[BucketEntry] = []
    offset = 0
    for name, tensor in named_tensors:
        raw = tensor.flatten().view(torch.uint8)
        parts.append(raw)
        entries.append(BucketEntry(name, tuple(tensor.shape), tensor.dtype, offset, offset + raw.numel()))
        offset += raw.numel()
    if not parts:
        raise ValueError("Cannot create empty tensor bucket")
    return torch.cat(parts, dim=0), entries


def bucket_layout(
    names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> tuple[list[BucketEntry], str | None]:
    """The receiver's layout (SGLang's `FlattenedTensorBucket.empty`) and its first error, SGLang's text:
    a negative dimension, or a tensor whose byte offset its dtype's size does not divide."""
    entries: list[BucketEntry] = []
    error: str | None = None
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        size = torch.Size(shape)
        if error is None and any(d < 0 for d in size):
            error = f"Negative dimension in received tensor {name}: {size}"
        if error is None and offset % dtype.itemsize:
            error = f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"
        nbytes = max(size.numel(), 0) * dtype.itemsize
        entries.append(BucketEntry(name, tuple(size), dtype, offset, offset + nbytes))
        offset += nbytes
    if not entries and error is None:
        error = "Cannot create empty tensor bucket"
    return entries, error


def broadcast_flattened_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, group: dist.ProcessGroup
) -> list[BucketEntry]:
    """Rank 0: send the tensors as one flattened bucket; returns the layout (names, dtypes, shapes for the
    `/update_weights_from_distributed` request with `load_format: "flattened_bucket"`)."""
    flat, entries = flatten_bucket(named_tensors)
    dist.broadcast(flat, src=0, group=group)
    return entries


def receive_flattened_bucket(
    *,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """Engine side: one broadcast of the whole bucket, then the tensors as views into it, in order.

    A layout SGLang refuses raises ValueError with its message, but only after the bytes arrived (SGLang
    refuses before receiving, leaving the sender's broadcast hanging)."""
    entries, error = bucket_layout(names, dtypes, shapes)
    flat = torch.empty(entries[-1].end if entries else 0, dtype=torch.uint8)
    dist.broadcast(flat, src=0, group=group)
    if error is not None:
        raise ValueError(error)
    return [flat[e.start : e.end].view(e.dtype).reshape(e.shape) for e in entries]


def destroy_process_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)

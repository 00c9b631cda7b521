"""`VLLMWeightGroup`: trainer rank 0's end of vLLM's native NCCL weight-transfer group, for weights by
broadcast to vLLM servers (`--rollout-backend vllm --update-weight-transfer-mode broadcast`, GPU only).

vLLM's workers join the group inside `/init_weight_transfer_engine` through vLLM's own rendezvous (a
`StatelessProcessGroup` whose TCPStore rank 0 hosts, then a PyNccl communicator), not through
torch.distributed, so rank 0 joins as vLLM's `nccl_common.trainer_init` does, but with the rendezvous
bounded by --engine-admin-timeout-s (vllm must be importable by the trainer's interpreter; it is, wherever
the run launches vLLM servers). Each bucket is then one NCCL
broadcast per tensor from rank 0, in `names` order, while the servers receive it inside `/update_weights`
(`inference.vllm.VLLMClient`). Unpacked (`packed: false` on both ends): the trainer's buckets already
bound how much travels per call. Read from vLLM 0.32's `distributed/weight_transfer/nccl_engine.py`; not
run here (no GPU on the development machine): `tests/gpu/test_vllm_nccl.py` checks it on one.

Everything blocks (the rendezvous waits for every worker) and runs on the rank's thread, never the loop.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["VLLMWeightGroup", "rendezvous"]


class VLLMWeightGroup:
    """A formed trainer ↔ vLLM-workers NCCL group; rank 0 of it is this process."""

    def __init__(self, communicator: Any) -> None:
        self._comm = communicator

    @classmethod
    def join(
        cls,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
    ) -> VLLMWeightGroup:
        """Host the rendezvous at master_address:master_port as rank 0 of `world_size` and form the
        group; returns once every worker joined (they do inside `/init_weight_transfer_engine`). Raises
        once `timeout_s` passed without all of them (a server that refused the init never comes).

        What vLLM's `nccl_common.trainer_init` does, with the rendezvous bounded: it hosts the store with
        vLLM's default wait (300 s) whatever the run's --engine-admin-timeout-s says."""
        if device.type != "cuda":
            raise RuntimeError("vLLM's weight transfer is NCCL only: the trainer must run on a GPU")
        pynccl = importlib.import_module("vllm.distributed.device_communicators.pynccl")
        nccl_env = importlib.import_module("vllm.utils.nccl")
        torch.cuda.set_device(device)
        group = rendezvous(
            master_address=master_address, master_port=master_port, world_size=world_size, timeout_s=timeout_s
        )
        with nccl_env.unpinned_nccl_env():
            return cls(pynccl.PyNcclCommunicator(group, device=torch.cuda.current_device()))

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast each tensor from rank 0, in order; returns once the last one was sent."""
        stream = torch.cuda.current_stream()
        for _, tensor in tensors:
            # NCCL sends numel elements from data_ptr(): a non-contiguous view must be copied first.
            self._comm.broadcast(tensor.contiguous(), src=0, stream=stream)
        stream.synchronize()

    def destroy(self) -> None:
        self._comm.destroy()


def rendezvous(*, master_address: str, master_port: int, world_size: int, timeout_s: float) -> Any:
    """Host vLLM's rendezvous (a `StatelessProcessGroup` whose TCPStore this rank, 0, serves) and wait up
    to `timeout_s` for the other `world_size - 1` ranks to connect; raises if they did not (torch's
    store raises a timeout error naming the count that came). Runs without CUDA."""
    dist_utils = importlib.import_module("vllm.distributed.utils")
    try:
        return dist_utils.StatelessProcessGroup.create(
            host=master_address,
            port=master_port,
            rank=0,
            world_size=world_size,
            store_timeout=max(1, math.ceil(timeout_s)),
        )
    except OSError as exc:
        # vLLM 0.32 closes the listening socket torch's store already closed when it gave up, so the
        # store's "Timed out ... 1/2 clients joined" surfaces as EBADF: report the store's error instead.
        if exc.__context__ is None:
            raise
        raise TimeoutError(f"vLLM weight-transfer rendezvous: {exc.__context__}") from exc.__context__

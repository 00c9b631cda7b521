"""`VLLMWeightGroup`: trainer rank 0's end of vLLM's native NCCL weight-transfer group, for weights by
broadcast to vLLM servers (`--rollout-backend vllm --update-weight-transfer-mode broadcast`, GPU only).

vLLM's workers join the group inside `/init_weight_transfer_engine` through vLLM's own rendezvous (a
`StatelessProcessGroup` whose TCPStore rank 0 hosts, then a PyNccl communicator), not through
torch.distributed, so rank 0 joins with vLLM's `nccl_common.trainer_init` (vllm must be importable by the
trainer's interpreter; it is, wherever the run launches vLLM servers). Each bucket is then one NCCL
broadcast per tensor from rank 0, in `names` order, while the servers receive it inside `/update_weights`
(`inference.vllm.VLLMClient`). Unpacked (`packed: false` on both ends): the trainer's buckets already
bound how much travels per call. Read from vLLM 0.32's `distributed/weight_transfer/nccl_engine.py`; not
run here (no GPU on the development machine): `tests/gpu/test_vllm_nccl.py` checks it on one.

Everything blocks (the rendezvous waits for every worker) and runs on the rank's thread, never the loop.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["VLLMWeightGroup"]


class VLLMWeightGroup:
    """A formed trainer ↔ vLLM-workers NCCL group; rank 0 of it is this process."""

    def __init__(self, communicator: Any) -> None:
        self._comm = communicator

    @classmethod
    def join(
        cls, *, master_address: str, master_port: int, world_size: int, device: torch.device
    ) -> VLLMWeightGroup:
        """Host the rendezvous at master_address:master_port as rank 0 of `world_size` and form the
        group; returns once every worker joined (they do inside `/init_weight_transfer_engine`)."""
        if device.type != "cuda":
            raise RuntimeError("vLLM's weight transfer is NCCL only: the trainer must run on a GPU")
        nccl_common = importlib.import_module("vllm.distributed.weight_transfer.nccl_common")
        torch.cuda.set_device(device)  # trainer_init uses the current device
        info = {"master_address": master_address, "master_port": master_port, "world_size": world_size}
        return cls(nccl_common.trainer_init(info, rank=0))

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast each tensor from rank 0, in order; returns once the last one was sent."""
        stream = torch.cuda.current_stream()
        for _, tensor in tensors:
            # NCCL sends numel elements from data_ptr(): a non-contiguous view must be copied first.
            self._comm.broadcast(tensor.contiguous(), src=0, stream=stream)
        stream.synchronize()

    def destroy(self) -> None:
        self._comm.destroy()

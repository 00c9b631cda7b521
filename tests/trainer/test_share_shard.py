"""`rank_main.share_shard`: a model-parallel group's source rank passes the controller's shard on to its
peers (real gloo process groups, one process per rank). The megatron TP/PP tests train through it end to
end; here the tensors themselves are compared, in a subgroup that leaves a rank out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miles_aio.trainer import losses, protocol
from miles_aio.trainer.rank_main import share_shard
from tests.trainer.helpers import make_batch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


def _shard() -> dict[str, torch.Tensor]:
    # prompt and response lengths vary, so a peer learns every field's size from the source
    batch = make_batch(7, groups=3, n=4, prompt_len=9, max_resp=40)
    n = sum(len(g) for g in batch)
    step = losses.shard_batch(
        batch, estimator="grpo", std_normalization=True, reward_key=None, global_batch_size=n, dp_size=1
    )
    return protocol.encode_batch(step.shards[0])


def _rank(rank: int, world: int, init: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = dist.new_group([1, 2])  # every rank creates every group; rank 0 is not in this one
        if rank in (1, 2):
            got = share_shard(
                _shard() if rank == 1 else {}, group=group, source=1, device=torch.device("cpu")
            )
            expected = _shard()
            same = list(got) == list(protocol.BATCH_FIELDS) and all(
                got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]) for k in expected
            )
            shapes = {k: list(v.shape) for k, v in got.items()}
            Path(out, f"rank{rank}").write_text("same" if same else f"differs: {shapes}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_source_rank_passes_its_shard_to_its_group(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    cmd = [sys.executable, "-m", "tests.trainer.test_share_shard", "3", init, str(tmp_path)]
    procs = [subprocess.Popen([*cmd, str(r)]) for r in range(3)]
    assert [p.wait(90) for p in procs] == [0, 0, 0]
    assert (tmp_path / "rank1").read_text() == "same"
    assert (tmp_path / "rank2").read_text() == "same"
    assert not (tmp_path / "rank0").exists()


def test_a_source_without_a_whole_shard_is_a_protocol_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        partial = dict(_shard())
        del partial["rollout_logp"]
        with pytest.raises(protocol.ProtocolError, match="rollout_logp"):
            share_shard(partial, group=dist.group.WORLD, source=0, device=torch.device("cpu"))  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # one rank of the first test
    world, init, out, rank = sys.argv[1:]
    _rank(int(rank), int(world), init, out)

"""Multi-node trainer ranks: started by `torchrun` (one per "node", both on loopback here), they dial
the controller's address with the run's secret, and train exactly as the ranks the controller spawns.

Tolerance: as tests/trainer/test_actor.py, parameters after one `train` (two AdamW steps) match the
1-rank run to 1e-5 absolute (2 data-parallel ranks sum partial gradients in another order; float32).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from miles_aio.trainer import protocol
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig
from miles_aio.trainer.rank_main import CONTROLLER_ENV
from tests.trainer.helpers import make_batch, run
from tests.trainer.helpers import train_cfg as _cfg

pytestmark = [pytest.mark.procs, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _one_step(
    cfg: TrainConfig, run_dir: Path, *, secret: bytes | None = None
) -> dict[str, torch.Tensor]:
    async with TrainerActor.open(cfg, run_dir=run_dir, secret=secret) as actor:
        await actor.train(0, make_batch(0))
        return await actor.get_weights()


async def _torchrun_nodes(cfg: TrainConfig, run_dir: Path) -> dict[str, torch.Tensor]:
    """The controller waits for ranks (actor_num_nodes 2: it spawns none); two torchrun "nodes" start them."""
    secret = protocol.new_secret()
    env = os.environ | {
        CONTROLLER_ENV: f"127.0.0.1:{cfg.trainer_port}",
        protocol.SECRET_ENV: secret.hex(),
        "OMP_NUM_THREADS": "1",
    }
    master_port = _free_port()
    nodes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={master_port}",
            "-m",
            "miles_aio.trainer.rank_main",
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
        )
        for node in range(2)
    ]
    try:
        weights = await _one_step(cfg, run_dir, secret=secret)
        # the actor shut the ranks down on exit: torchrun on each node exits cleanly
        async with asyncio.timeout(30):
            codes = [await p.wait() for p in nodes]
        assert codes == [0, 0]
        return weights
    finally:
        for p in nodes:
            if p.returncode is None:
                p.kill()
                await p.wait()


@pytest.mark.timeout(120)
def test_torchrun_ranks_dial_in_and_train_like_spawned_ones(model_dir: Path, tmp_path: Path) -> None:
    one = run(_one_step(_cfg(model_dir), tmp_path / "one"))
    multi = _cfg(
        model_dir,
        actor_num_nodes=2,
        actor_num_gpus_per_node=1,
        trainer_host="0.0.0.0",  # off loopback, as on a real cluster: the secret is required
        trainer_port=_free_port(),
        trainer_connect_timeout_s=90.0,
    )
    two = run(_torchrun_nodes(multi, tmp_path / "two"))
    assert set(one) == set(two)
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=0, msg=k)


def test_waiting_for_torchrun_ranks_without_a_secret_is_a_config_error(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles_aio.errors import ConfigError

    monkeypatch.delenv(protocol.SECRET_ENV, raising=False)
    cfg = _cfg(model_dir, actor_num_nodes=2, actor_num_gpus_per_node=1, trainer_host="0.0.0.0")
    with pytest.raises(ConfigError, match=protocol.SECRET_ENV):
        run(_one_step(cfg, tmp_path / "x"))

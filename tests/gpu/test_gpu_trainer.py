"""The trainer on CUDA: HF/FSDP and megatron-core (also PP=2) train steps, disk sync, an NCCL broadcast sync.

Skipped (with the reason shown) when `torch.cuda.is_available()` is False. Written for one or more
NVIDIA GPUs with a CUDA torch (Python 3.12, megatron-core 0.19 expected there). Self-contained: it does
not import the CPU test helpers. On GPU the forward runs under bf16 autocast with fp32 master weights,
so cross-backend comparisons use bf16-level tolerances (stated per assertion).
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_aio.inference.base import SingleServerBroadcast
from miles_aio.models.tiny import build_tiny_llama
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig
from miles_aio.types import Group, Sample, Status

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
    ),
]
ALPHABET = "0123456789+="
VOCAB = len(ALPHABET) + 3


def _batch(seed: int, groups: int = 2, n: int = 4) -> list[Group]:
    rng = random.Random(seed)
    out: list[Group] = []
    for g in range(groups):
        group: Group = []
        for k in range(n):
            r = rng.randrange(1, 6)
            tokens = [rng.randrange(3, VOCAB) for _ in range(4 + r)]
            group.append(
                Sample(
                    group_index=g,
                    index=g * n + k,
                    prompt="",
                    tokens=tokens,
                    response_length=r,
                    loss_mask=[1] * r,
                    rollout_log_probs=[-2.5] * r,
                    weight_versions=[1] * r,
                    reward=float(rng.random() < 0.5),
                    status=Status.COMPLETED,
                )
            )
        out.append(group)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64, as GPU attention kernels like it
    return build_tiny_llama(
        tmp_path_factory.mktemp("gpu") / "model",
        alphabet=ALPHABET,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
    )


def _cfg(model_dir: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {"hf_checkpoint": model_dir, "lr": 1e-3, "use_tis": True, "micro_batch_size": 2}
    return TrainConfig(**(base | kw))


async def _step(cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    probe = _batch(99)[0][0]
    async with TrainerActor.open(cfg, run_dir=run_dir) as actor:
        assert actor._device.startswith("cuda")
        before = (await actor.logprobs([probe.tokens], [probe.response_length]))[0]
        w0 = await actor.get_weights()
        metrics = await actor.train(0, _batch(0))
        w1 = await actor.get_weights()
        path = await actor.write_weights(1)
        return {
            "before": before,
            "metrics": metrics,
            "w0": w0,
            "w1": w1,
            "path": path,
            "wrapper": actor.wrapper,
        }


def _check_step(out: dict[str, Any]) -> None:
    assert all(math.isfinite(v) for v in out["metrics"].values()), out["metrics"]
    moved = max((out["w1"][k] - out["w0"][k]).abs().max().item() for k in out["w0"])
    assert moved > 1e-4, "one AdamW step at lr 1e-3 must move the weights"
    assert (out["path"] / "model.safetensors").exists() and (out["path"] / "config.json").exists()


def test_hf_and_megatron_train_steps_on_cuda(model_dir: Path, tmp_path: Path) -> None:
    hf = asyncio.run(_step(_cfg(model_dir), tmp_path / "hf"))
    _check_step(hf)
    from transformers import AutoModelForCausalLM  # the disk-sync snapshot is a loadable HF model

    loaded = AutoModelForCausalLM.from_pretrained(str(hf["path"]), dtype=torch.float32)
    torch.testing.assert_close(
        loaded.state_dict()["lm_head.weight"], hf["w1"]["lm_head.weight"], atol=0, rtol=0
    )
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    # REINFORCE++ with --kl-coef: the megatron backend also builds its frozen reference model on CUDA
    rpp = {"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.05, "normalize_advantages": True}
    mg = asyncio.run(_step(_cfg(model_dir, train_backend="megatron", **rpp), tmp_path / "mg"))
    _check_step(mg)
    assert mg["wrapper"].startswith("megatron")
    # Same initial weights, both under bf16 autocast: log-probs agree to bf16 precision.
    torch.testing.assert_close(mg["before"], hf["before"], atol=5e-2, rtol=0)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"pipeline parallelism needs 2 GPUs, one per stage; found {torch.cuda.device_count()}",
)
def test_megatron_pipeline_parallel_on_cuda(model_dir: Path, tmp_path: Path) -> None:
    """PP=2 over 2 GPUs (1F1B schedule over NCCL) trains like the 1-GPU megatron run."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    one = asyncio.run(_step(_cfg(model_dir, train_backend="megatron"), tmp_path / "pp1"))
    pp_cfg = _cfg(
        model_dir, train_backend="megatron", pipeline_model_parallel_size=2, actor_num_gpus_per_node=2
    )
    pp = asyncio.run(_step(pp_cfg, tmp_path / "pp2"))
    _check_step(pp)
    assert pp["wrapper"] == "megatron(tp=1,pp=2,dp=1)"
    assert set(pp["w1"]) == set(one["w1"])
    # Same kernels per layer under bf16 autocast, stages hand over fp32 activations: the log-probs agree
    # to bf16 precision, and the weights after one AdamW step (lr 1e-3) to within one step's size.
    torch.testing.assert_close(pp["before"], one["before"], atol=1e-2, rtol=0)
    for k, v in one["w1"].items():
        torch.testing.assert_close(pp["w1"][k], v, atol=2e-3, rtol=0, msg=k)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _NcclReceiver:
    """A stand-in engine on cuda:1 that speaks the two broadcast calls the actor makes (SGLang's
    `/init_weights_update_group` + `/update_weights_from_distributed` semantics), in-process."""

    def __init__(self) -> None:
        self.group: Any = None
        self.received: dict[str, torch.Tensor] = {}

    async def init_weights_update_group(self, **kw: Any) -> None:
        from miles_aio.weight_broadcast import init_custom_process_group

        def join() -> Any:
            torch.cuda.set_device(1)
            return init_custom_process_group(
                backend=kw["backend"],
                master_address=kw["master_address"],
                master_port=kw["master_port"],
                world_size=kw["world_size"],
                rank=kw["rank_offset"],
                group_name=kw["group_name"],
            )

        assert kw["backend"] == "nccl" and kw["world_size"] == 2
        self.group = await asyncio.to_thread(join)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "",
        last_bucket: bool = True,
    ) -> None:
        import torch.distributed as dist

        def receive() -> None:
            torch.cuda.set_device(1)
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda:1")
                dist.broadcast(t, src=0, group=self.group)
                self.received[name] = t.cpu()
            torch.cuda.synchronize(1)

        await asyncio.to_thread(receive)

    async def server_info(self) -> dict[str, Any]:
        return {"tp_size": 1}

    async def destroy_weights_update_group(self, group_name: str) -> None:
        return None

    def weight_broadcast(self) -> SingleServerBroadcast:
        return SingleServerBroadcast(self)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL cannot broadcast between two processes on one GPU (duplicate device); needs 2 GPUs",
)
def test_nccl_broadcast_weight_sync(model_dir: Path, tmp_path: Path) -> None:
    receiver = _NcclReceiver()

    async def main() -> dict[str, torch.Tensor]:
        cfg = _cfg(model_dir, update_weight_transfer_mode="broadcast", update_weight_buffer_size=1 << 20)
        async with TrainerActor.open(cfg, run_dir=tmp_path) as actor:
            await actor.train(0, _batch(0))
            await actor.sync_weights(receiver, version=1)  # type: ignore[arg-type]
            return await actor.get_weights()

    weights = asyncio.run(main())
    assert set(receiver.received) == set(weights)
    for k, v in weights.items():
        torch.testing.assert_close(receiver.received[k], v, atol=0, rtol=0, msg=k)

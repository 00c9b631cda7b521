"""Pipeline parallelism in the megatron backend on CPU (gloo + the CPU shim): PP=2 trains like one rank.

Two rank processes, one pipeline stage each (layer 0 + embedding; layer 1 + norm + output layer),
under megatron-core's 1F1B schedule with micro-batch size 1, so four micro-batches per optimizer step
are in flight across the stages. The loss has every term that needs log-probs on the last stage:
recomputed π_old, the reference model's KL, TIS and an entropy bonus.

Tolerances (measured on this machine in brackets):
  - weights after one `train` call (2 AdamW steps, lr 1e-3) vs the 1-rank HF/transformers trainer:
    1e-4 absolute [1.4e-5 untied, 1.4e-6 tied: same math, other kernels; Adam's first steps
    normalise the update, so a near-zero gradient entry magnifies kernel-level differences];
  - metrics (rank 0 reports the last stage's): 1e-5 relative [≤ 1e-6];
  - engine vs trainer log-probs after a broadcast and a disk sync: 1e-4 absolute, as in
    test_engine_sync.py [≈ 2e-7];
  - a checkpoint round trip on the same layout: 1e-6 absolute [exact].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_aio.errors import ConfigError
from miles_aio.inference.local_launch import launch_local_engines
from miles_aio.inference.router import EngineRouter
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig, check_model_layers
from tests.trainer.helpers import make_batch, run

PROMPT = [5, 9, 4, 7, 12, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
BASE: dict[str, Any] = {
    "lr": 1e-3,
    "use_tis": True,
    "use_kl_loss": True,
    "kl_loss_coef": 0.1,
    "entropy_coef": 0.01,
    "micro_batch_size": 1,
    "global_batch_size": 4,
}


def test_pipeline_config_validation(model_dir: Path) -> None:
    ok = TrainConfig(
        train_backend="megatron",
        hf_checkpoint=model_dir,
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=2,
        actor_num_gpus_per_node=8,
    )
    assert ok.dp_size == 2
    bad: list[tuple[dict[str, Any], str]] = [
        ({"pipeline_model_parallel_size": 2, "actor_num_gpus_per_node": 3}, "world size 3"),
        ({"pipeline_model_parallel_size": 4, "actor_num_gpus_per_node": 4}, "2 decoder layers"),
        ({"pipeline_model_parallel_size": 0}, "must be >= 1"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=message) as info:
            check_model_layers(TrainConfig(train_backend="megatron", hf_checkpoint=model_dir, **kwargs))
        assert "--pipeline-model-parallel-size" in info.value.flags
    with pytest.raises(ConfigError) as info:
        TrainConfig(pipeline_model_parallel_size=2, actor_num_gpus_per_node=2)
    assert "--train-backend" in info.value.flags


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_megatron_pp2_matches_one_rank_syncs_engines_and_checkpoints(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    hf_cfg = TrainConfig(hf_checkpoint=model_dir, **BASE)
    pp_cfg = TrainConfig(
        hf_checkpoint=model_dir,
        **BASE,
        train_backend="megatron",
        pipeline_model_parallel_size=2,
        actor_num_gpus_per_node=2,
        update_weight_transfer_mode="broadcast",
        update_weight_buffer_size=40_000,  # several buckets, tensors from both stages in each
    )

    async def reference() -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        async with TrainerActor.open(hf_cfg, run_dir=tmp_path / "hf") as actor:
            metrics = await actor.train(0, make_batch(1))
            return metrics, await actor.get_weights()

    async def engine_matches(actor: TrainerActor, router: EngineRouter, version: int) -> None:
        out = await router.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out.weight_versions == [version] * len(out.output_ids)
        (trainer,) = await actor.logprobs([PROMPT + out.output_ids], [len(out.output_ids)])
        assert out.output_log_probs == pytest.approx(trainer.tolist(), abs=1e-4)

    async def pipeline() -> dict[str, Any]:
        async with (
            launch_local_engines(model_dir, num_engines=1, weights_root=tmp_path) as urls,
            EngineRouter.open(urls) as router,
            TrainerActor.open(pp_cfg, run_dir=tmp_path / "pp") as actor,
        ):
            assert actor.wrapper == "megatron(tp=1,pp=2,dp=1)"
            got: dict[str, Any] = {"metrics": await actor.train(0, make_batch(1))}
            got["after_one"] = await actor.get_weights()
            stale = await router.generate(input_ids=PROMPT, sampling_params=GREEDY)
            (fresh,) = await actor.logprobs([PROMPT + stale.output_ids], [len(stale.output_ids)])
            assert max(abs(a - b) for a, b in zip(stale.output_log_probs, fresh.tolist(), strict=True)) > 1e-3
            await actor.sync_weights(router, version=1)  # broadcast: rank 0 gathers both stages
            await engine_matches(actor, router, 1)
            await actor.save(0, tmp_path / "ckpt")
            await actor.train(1, make_batch(2))
            got["straight"] = await actor.get_weights()
            actor.cfg = dataclasses.replace(pp_cfg, update_weight_transfer_mode="disk")
            await actor.sync_weights(router, version=2)
            await engine_matches(actor, router, 2)
            assert await actor.load(tmp_path / "ckpt") == 0
            await actor.train(1, make_batch(2))
            got["resumed"] = await actor.get_weights()
            return got

    ref_metrics, ref_weights = run(reference())
    got = run(pipeline())
    assert set(got["after_one"]) == set(ref_weights)
    for k, v in ref_weights.items():
        torch.testing.assert_close(got["after_one"][k], v, atol=1e-4, rtol=0, msg=k)
        torch.testing.assert_close(got["resumed"][k], got["straight"][k], atol=1e-6, rtol=0, msg=k)
    for k in ("train/loss", "train/kl_loss", "train/entropy", "train/ppo_kl", "train/tis_weight"):
        assert got["metrics"][k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), k
    assert got["metrics"]["train/ppo_kl"] != 0  # the second optimizer step ran against π_old
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} >= {
        "optimizer_rank0.safetensors",
        "optimizer_rank1.safetensors",
        "rng_rank1.safetensors",
    }

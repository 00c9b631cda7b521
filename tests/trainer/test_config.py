"""TrainConfig validation, the batch-arithmetic and off-policy cross checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_aio.errors import ConfigError
from miles_aio.trainer.config import TrainConfig, check_batch_arithmetic, check_off_policy_correction

pytestmark = [pytest.mark.pure, pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"train_backend": "deepspeed"}, "--train-backend"),
        ({"advantage_estimator": "ppo"}, "--advantage-estimator"),
        ({"kl_loss_type": "k4"}, "--kl-loss-type"),
        ({"update_weight_transfer_mode": "p2p"}, "--update-weight-transfer-mode"),
        ({"micro_batch_size": 0}, "--micro-batch-size"),
        ({"lr": 0.0}, "--lr"),
        ({"eps_clip": 1.5}, "--eps-clip"),
        ({"eps_clip_high": -0.1}, "--eps-clip-high"),
        ({"tis_clip": 0.5, "tis_clip_low": 0.5}, "--tis-clip"),
        ({"global_batch_size": 4, "num_steps_per_rollout": 2}, "--num-steps-per-rollout"),
        ({"use_rollout_logprobs": True, "use_tis": True}, "--use-rollout-logprobs"),
        ({"tensor_model_parallel_size": 2, "actor_num_gpus_per_node": 2}, "--train-backend"),
        ({"train_backend": "megatron", "tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
        ({"actor_num_nodes": 2}, "--trainer-host"),
        ({"train_backend": "megatron", "pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size"),
    ],
)
def test_invalid_values_name_their_flags(kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)  # type: ignore[arg-type]
    assert flag in info.value.flags


def test_batch_arithmetic() -> None:
    check_batch_arithmetic(TrainConfig(), 32)  # default: one optimizer step over everything
    check_batch_arithmetic(TrainConfig(global_batch_size=8, actor_num_gpus_per_node=2), 32)
    assert TrainConfig(num_steps_per_rollout=4).optimizer_steps(32) == 4
    for cfg, n in [(TrainConfig(global_batch_size=12), 32), (TrainConfig(global_batch_size=64), 32)]:
        with pytest.raises(ConfigError) as info:
            check_batch_arithmetic(cfg, n)
        assert "--global-batch-size" in info.value.flags
    with pytest.raises(ConfigError, match="data-parallel"):
        check_batch_arithmetic(TrainConfig(global_batch_size=3, actor_num_gpus_per_node=2), 6)
    with pytest.raises(ConfigError, match="optimizer steps"):
        check_batch_arithmetic(TrainConfig(num_steps_per_rollout=3), 32)


def test_fully_async_needs_some_off_policy_correction() -> None:
    with pytest.raises(ConfigError, match="refuse to start a fully async run") as info:
        check_off_policy_correction(TrainConfig(), fully_async=True)
    assert "--allow-uncorrected-off-policy" in info.value.flags
    check_off_policy_correction(TrainConfig(), fully_async=False)
    for ok in (
        {"use_tis": True},
        {"use_decoupled_loss": True},
        {"use_rollout_logprobs": True},
        {"allow_uncorrected_off_policy": True},
    ):
        check_off_policy_correction(TrainConfig(**ok), fully_async=True)  # type: ignore[arg-type]


def test_json_round_trip() -> None:
    cfg = TrainConfig(hf_checkpoint=Path("/m"), use_tis=True, eps_clip_high=0.28, lr=3e-4)
    assert TrainConfig.from_json(cfg.to_json()) == cfg

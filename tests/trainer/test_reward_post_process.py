"""--custom-reward-post-process-path (miles): the hook's rewards replace the estimator's group
normalization; a bad hook is named, at start-up (a bad path) or at the step (a bad answer)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from miles_aio.errors import ConfigError
from miles_aio.plugins import resolve_plugins
from miles_aio.trainer import losses
from miles_aio.trainer.config import TrainConfig
from miles_aio.trainer.reward_post import RewardPostProcess
from miles_aio.types import Sample
from tests.helpers import make_config
from tests.trainer.helpers import make_batch

CALLS: list[tuple[Any, list[Sample]]] = []


def doubled(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """A miles-style post-process: keeps the raw rewards, trains on 2 × reward − 1."""
    CALLS.append((args, samples))
    raw = [float(s.reward) for s in samples]  # type: ignore[arg-type]
    return raw, [2 * r - 1 for r in raw]


def short(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    return [], [0.0]


async def not_plain(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    return [], []


def test_the_hooks_rewards_replace_the_group_normalization() -> None:
    groups = [[0.0, 1.0, 1.0], [0.5, 0.5, 0.5]]
    processed = [[-1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # grpo / gspo: the processed rewards are the advantages (no mean/std on top)
    for est in ("grpo", "gspo"):
        assert losses.compute_advantages(processed, est, post_processed=True) == processed
    assert losses.compute_advantages(groups, "grpo") != groups  # (without it: normalized)
    # reinforce_plus_plus_baseline: no group mean, only the rollout-wide whitening
    flat = [-1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    mean = sum(flat) / 6
    std = (sum((x - mean) ** 2 for x in flat) / 5) ** 0.5
    got = losses.compute_advantages(processed, "reinforce_plus_plus_baseline", post_processed=True)
    assert [a for g in got for a in g] == pytest.approx([(x - mean) / (std + 1e-6) for x in flat])
    with pytest.raises(ConfigError) as info:
        TrainConfig(custom_reward_post_process_path="m:f", advantage_estimator="rloo")
    assert "--custom-reward-post-process-path" in info.value.flags


def test_shard_batch_trains_on_the_hooks_rewards_in_sample_order() -> None:
    CALLS.clear()
    batch = make_batch(0, groups=2, n=4)
    hook = RewardPostProcess(doubled, SimpleNamespace(n_samples_per_prompt=4))
    processed = hook(batch)
    assert len(CALLS) == 1 and [s.index for s in CALLS[0][1]] == [s.index for g in batch for s in g]
    assert CALLS[0][0].n_samples_per_prompt == 4
    kw: dict[str, Any] = {"std_normalization": True, "reward_key": None, "global_batch_size": 8, "dp_size": 1}
    out = losses.shard_batch(batch, estimator="grpo", processed_rewards=processed, **kw)
    assert out.advantages == pytest.approx(processed)
    assert [r.advantage for r in out.shards[0]] == pytest.approx(processed)


def test_a_bad_hook_is_named() -> None:
    batch = make_batch(0, groups=1, n=2)
    with pytest.raises(ValueError, match="one finite reward per sample"):
        RewardPostProcess(short, SimpleNamespace())(batch)
    with pytest.raises(ConfigError, match="plain function") as info:
        resolve_plugins(make_config(custom_reward_post_process_path=f"{__name__}:not_plain"))
    assert "--custom-reward-post-process-path" in info.value.flags
    with pytest.raises(ConfigError):
        resolve_plugins(make_config(custom_reward_post_process_path=f"{__name__}:missing"))
    cfg = make_config(custom_reward_post_process_path=f"{__name__}:doubled")
    resolve_plugins(cfg)
    hook = RewardPostProcess.from_config(cfg.train, cfg)
    assert hook is not None and hook._args.config is cfg  # miles-style flat args, as the logging hooks

"""Builders shared by tests: small configs, data sources and plug-ins for the fake engine/trainer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from miles_aio.config import (
    BufferConfig,
    DataConfig,
    DriverConfig,
    EngineConfig,
    EvalConfig,
    ObservabilityConfig,
    RolloutConfig,
    RunConfig,
    SchedulerConfig,
    TrainConfig,
)
from miles_aio.data.source import DataSource, PromptRecord
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import Group, Sample


def make_config(run_dir: Path | None = None, **overrides: Any) -> RunConfig:
    """A RunConfig from flat field overrides (any component's field name)."""
    parts: dict[str, Any] = {}
    defaults: dict[str, Any] = {
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "num_rollout": 3,
        "custom_rm_path": "tests.helpers:length_reward",
        "use_tis": True,
        "rollout_max_response_len": 64,
    }
    values = {**defaults, **overrides}
    for attr, cls in (
        ("data", DataConfig),
        ("rollout", RolloutConfig),
        ("scheduler", SchedulerConfig),
        ("buffer", BufferConfig),
        ("driver", DriverConfig),
        ("eval", EvalConfig),
        ("engine", EngineConfig),
        ("train", TrainConfig),
        ("observability", ObservabilityConfig),
    ):
        names = {f.name for f in dataclasses.fields(cls)}
        parts[attr] = cls(**{k: values.pop(k) for k in list(values) if k in names})
    assert not values, f"unknown config fields {values}"
    return RunConfig(run_dir=run_dir or Path("unused"), **parts)


def make_source(n_prompts: int = 50, n: int = 2, seed: int = 0) -> DataSource:
    return DataSource(
        [PromptRecord(f"prompt {i}", label=i) for i in range(n_prompts)],
        n_samples_per_prompt=n,
        seed=seed,
        shuffle=True,
    )


async def length_reward(ctx: RolloutContext, sample: Sample) -> float:
    return float(sample.response_length % 2)


async def raising_reward(ctx: RolloutContext, sample: Sample) -> float:
    raise RuntimeError("reward exploded")


async def uniform_reward_every_third_group(ctx: RolloutContext, sample: Sample) -> float:
    """Every sample of a group whose index is a multiple of 3 gets 1.0; the others alternate 0 and 1."""
    return 1.0 if sample.group_index % 3 == 0 else float(sample.index % 2)


def keep_even_groups(ctx: RolloutContext, group: Group) -> tuple[bool, str]:
    return group[0].group_index % 2 == 0, "odd_group"


async def flaky_reward(ctx: RolloutContext, sample: Sample) -> float:
    """Raises for every third group: user code that sometimes crashes."""
    if sample.group_index % 3 == 0:
        raise ValueError(f"cannot score group {sample.group_index}")
    return 1.0

"""`--custom-reward-post-process-path`: miles' reward post-processing hook, run on the controller.

    def post_process_rewards(args, samples) -> tuple[list[float], list[float]]
        once per rollout, before the advantages: `samples` the rollout's samples, group after group
        (each group `n_samples_per_prompt` long, as miles lays them out); returns the raw rewards (for
        the record) and the rewards the estimator uses *instead of its group normalization* (see
        `losses.compute_advantages(post_processed=True)`).

`args` is the flat namespace of every flag the logging hooks get (`observability.hooks.flat_args`). The
hook is user code on the training path: an exception, or an answer of the wrong shape, stops the run
with a message naming the flag (a partial rollout cannot be trained on).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from miles_aio.config import RunConfig
from miles_aio.errors import ConfigError
from miles_aio.import_paths import load_object
from miles_aio.trainer.config import TrainConfig
from miles_aio.types import Group

__all__ = ["RewardPostProcess"]

FLAG = "--custom-reward-post-process-path"


class RewardPostProcess:
    """The loaded hook and the `args` it is called with."""

    def __init__(self, fn: Callable[..., Any], args: SimpleNamespace) -> None:
        self._fn = fn
        self._args = args

    @classmethod
    def from_config(cls, train_cfg: TrainConfig, run_cfg: RunConfig | None) -> RewardPostProcess | None:
        path = train_cfg.custom_reward_post_process_path
        if path is None:
            return None
        from miles_aio.observability.hooks import flat_args

        fields = {f.name: getattr(train_cfg, f.name) for f in dataclasses.fields(train_cfg)}
        args = flat_args(run_cfg) if run_cfg is not None else SimpleNamespace(**fields)
        fn = load_object(path)
        if not callable(fn):
            raise ConfigError(f"{path!r} is not callable", flags=[FLAG])
        return cls(fn, args)

    def __call__(self, batch: Sequence[Group]) -> list[float]:
        """The rewards the estimator uses, one per sample of `batch` (flattened in order)."""
        samples = [s for g in batch for s in g]
        out = self._fn(self._args, samples)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise ValueError(f"{FLAG}: must return (raw_rewards, rewards), got {type(out).__name__}")
        rewards = [float(r) for r in out[1]]
        if len(rewards) != len(samples) or not all(map(math.isfinite, rewards)):
            raise ValueError(
                f"{FLAG}: must return one finite reward per sample ({len(samples)}), got {out[1]!r:.200}"
            )
        return rewards

"""Built-in dynamic sampling filters for `--dynamic-sampling-filter-path` (put-time group filters).

    --dynamic-sampling-filter-path miles_aio.rollout.filters:reward_nonzero_std

`reward_nonzero_std` is miles' `check_reward_nonzero_std` (DAPO's dynamic sampling): a group whose
samples all got the same reward has a group-normalised advantage of zero for every sample, so it adds
no gradient, only weight to a token-mean loss's denominator; it is dropped (reason `zero_std_<reward>`,
counted as `rollout/dynamic_filter/drop_zero_std_<reward>`) and rollout keeps going until a step has
`--rollout-batch-size` groups that teach something.
"""

from __future__ import annotations

from miles_aio.buffer.base import FilterDecision
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import Group, scalar_reward

__all__ = ["reward_nonzero_std"]


def reward_nonzero_std(ctx: RolloutContext, group: Group) -> FilterDecision:
    """Keep the group if its samples' rewards (`--reward-key` for dict rewards) are not all equal."""
    key = ctx.config.train.reward_key
    rewards = [scalar_reward(s.reward, key) for s in group]
    if any(r != rewards[0] for r in rewards):
        return FilterDecision(True)
    return FilterDecision(False, f"zero_std_{round(rewards[0], 1) if rewards else 'empty'}")

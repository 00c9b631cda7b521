"""The built-in dynamic sampling filter: miles' check_reward_nonzero_std (DAPO's dynamic sampling)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_aio.rollout.filters import reward_nonzero_std
from miles_aio.types import Sample

pytestmark = pytest.mark.pure


def ctx(reward_key: str | None = None) -> Any:
    return SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(reward_key=reward_key)))


def group(rewards: list[Any]) -> list[Sample]:
    return [Sample(group_index=7, index=i, prompt="p", reward=r) for i, r in enumerate(rewards)]


@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=16))
def test_a_group_is_kept_exactly_when_its_rewards_differ(rewards: list[float]) -> None:
    decision = reward_nonzero_std(ctx(), group(rewards))
    assert decision.keep == (len(set(rewards)) > 1)
    if not decision.keep:
        assert decision.reason == f"zero_std_{rewards[0]}"


def test_dict_rewards_are_read_through_the_reward_key() -> None:
    same = group([{"acc": 1.0, "len": 3}, {"acc": 1.0, "len": 5}])
    assert not reward_nonzero_std(ctx("acc"), same).keep
    assert reward_nonzero_std(ctx("len"), same).keep
    with pytest.raises(ValueError, match="needs --reward-key"):
        reward_nonzero_std(ctx(), same)  # the user's config is wrong: the failure policy decides

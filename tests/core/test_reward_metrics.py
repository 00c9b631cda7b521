"""rollout/reward and eval/<ds>/reward read a dict reward the way training does: its --reward-key entry."""

from __future__ import annotations

import pytest

from miles_aio.eval.shared import dataset_metrics
from miles_aio.metrics import reward_value, rollout_batch_metrics
from miles_aio.types import Sample, Status

pytestmark = pytest.mark.pure


def sample(i: int, reward: object) -> Sample:
    return Sample(
        group_index=0,
        index=i,
        prompt="",
        tokens=[1, 2, 3],
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-1.0],
        weight_versions=[1],
        reward=reward,  # type: ignore[arg-type]
        status=Status.COMPLETED,
    )


def test_a_dict_reward_counts_by_its_reward_key() -> None:
    assert reward_value({"acc": 1.0, "score": 0.25}, "acc") == 1.0
    assert reward_value({"acc": 1.0, "score": 0.25}) == 0.25  # no key: "reward", else "score"
    assert reward_value({"acc": 1.0}, "missing") is None
    assert reward_value(0.5, "acc") == 0.5
    group = [sample(0, {"acc": 1.0, "len_penalty": -0.5}), sample(1, {"acc": 0.0, "len_penalty": -0.1})]
    assert rollout_batch_metrics([group], version=1, reward_key="acc")["rollout/reward"] == 0.5
    assert rollout_batch_metrics([group], version=1)["rollout/reward"] == 0.0  # nothing to read
    evals = dataset_metrics("ds", group, reward_key="acc")
    assert evals["eval/ds/reward"] == pytest.approx(0.5) and evals["eval/ds/accuracy"] == pytest.approx(0.5)


def test_model_token_ratio_is_the_share_of_response_tokens_at_loss_mask_1() -> None:
    multi_turn = Sample(
        group_index=0,
        index=2,
        prompt="",
        tokens=[1, 2, 3, 4, 5, 6, 7],
        response_length=6,
        loss_mask=[1, 1, 0, 0, 0, 1],  # a reply, a tool's output, the answer
        rollout_log_probs=[-1.0, -1.0, 0.0, 0.0, 0.0, -1.0],
        weight_versions=[1, 1, None, None, None, 1],
        reward=1.0,
        status=Status.COMPLETED,
    )
    assert rollout_batch_metrics([[sample(0, 1.0), sample(1, 0.0)]], version=1)[
        "rollout/model_token_ratio"
    ] == pytest.approx(1.0)
    assert rollout_batch_metrics([[sample(0, 1.0), multi_turn]], version=1)[
        "rollout/model_token_ratio"
    ] == pytest.approx(4 / 7)

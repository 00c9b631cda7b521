from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_aio.types import (
    BufferItem,
    FinishReason,
    GenerateOutput,
    Sample,
    Status,
    group_oldest_version,
    group_staleness,
)

pytestmark = pytest.mark.pure


def out(n: int, version: int | None, finish: FinishReason = "stop") -> GenerateOutput:
    return GenerateOutput(
        text="x" * n,
        output_ids=list(range(n)),
        output_log_probs=[-0.5] * n,
        weight_versions=[version] * n,
        finish_reason=finish,
    )


def test_append_keeps_response_lists_aligned_and_maps_finish_reason() -> None:
    s = Sample(group_index=0, index=0, prompt="p", tokens=[7, 8])
    s.append(out(3, 1, "stop"))
    s.append_context([100, 101], "tool")
    s.append(out(2, 2, "length"))
    s.validate()
    assert s.response_length == 7
    assert s.prompt_length == 2
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert s.weight_versions == [1, 1, 1, None, None, 2, 2]
    statuses = [s.status]
    s.append(out(1, 3, "abort"))
    statuses.append(s.status)
    assert statuses == [Status.TRUNCATED, Status.ABORTED]


def test_generate_output_rejects_misaligned_lists() -> None:
    with pytest.raises(ValueError, match="disagree"):
        GenerateOutput(
            text="", output_ids=[1, 2], output_log_probs=[0.0], weight_versions=[1, 1], finish_reason="stop"
        )


def test_staleness_is_unknown_not_zero_before_any_version() -> None:
    s = Sample(group_index=0, index=0, prompt="p")
    s.append(out(2, None))
    assert s.oldest_weight_version is None
    assert group_staleness([s], 5) is None
    t = Sample(group_index=0, index=1, prompt="p")
    t.append(out(2, 3))
    assert group_staleness([s, t], None) is None
    assert group_staleness([s, t], 5) == 2


def test_group_staleness_uses_the_oldest_token_across_samples() -> None:
    a = Sample(group_index=0, index=0, prompt="p")
    a.append(out(2, 4))
    a.append(out(2, 6))
    b = Sample(group_index=0, index=1, prompt="p")
    b.append(out(1, 5))
    assert group_oldest_version([a, b]) == 4
    assert group_staleness([a, b], 7) == 3


def test_reset_for_retry_keeps_identity_and_prompt_tokens() -> None:
    s = Sample(group_index=3, index=12, prompt="p", label="l", tokens=[1, 2], reward=1.0, metadata={"k": 1})
    s.append(out(3, 1))
    s.reset_for_retry()
    assert (s.group_index, s.index, s.prompt, s.label, s.metadata) == (3, 12, "p", "l", {"k": 1})
    assert s.tokens == [1, 2]
    assert s.response_length == 0 and s.reward is None and s.status == Status.PENDING
    s.validate()


def test_buffer_item_round_trips_through_dict() -> None:
    s = Sample(group_index=1, index=2, prompt=[{"role": "user", "content": "hi"}], tokens=[5])
    s.append(out(2, 1))
    item = BufferItem(group=[s], prompt_group=[Sample(group_index=1, index=2, prompt="p")])
    again = BufferItem.from_dict(item.to_dict())
    assert again.group[0] == s
    assert again.group[0].status is Status.COMPLETED
    assert again.group_index == 1


def test_token_staleness_histogram_is_token_weighted_over_trained_tokens() -> None:
    from miles_aio.metrics import token_staleness_histogram

    s = Sample(group_index=0, index=0, prompt="p")
    s.append(out(3, 5))  # staleness 0 at version 5
    s.append_context([1, 2])  # not trained: ignored
    s.append(out(1, 4))  # staleness 1
    t = Sample(group_index=0, index=1, prompt="p")
    t.append(out(4, 0))  # staleness 5 → "4+"
    h = token_staleness_histogram([s, t], version=5)
    assert h == {
        "rollout/token_staleness/0": 3 / 8,
        "rollout/token_staleness/1": 1 / 8,
        "rollout/token_staleness/2": 0.0,
        "rollout/token_staleness/3": 0.0,
        "rollout/token_staleness/4+": 4 / 8,
    }
    assert sum(token_staleness_histogram([s], version=None).values()) == 0.0


_segments = st.lists(
    st.tuples(st.integers(0, 6), st.one_of(st.none(), st.integers(0, 300)), st.booleans()), max_size=5
)


@given(st.lists(_segments, min_size=1, max_size=6), st.integers(0, 6))
def test_staleness_metrics_equal_a_per_token_count(
    samples_segments: list[list[tuple[int, int | None, bool]]], ahead: int
) -> None:
    """The per-sample fast paths (one policy per sample: a C scan) give exactly what counting every
    trained token gives, for samples that mix versions, unknown versions and untrained context."""
    from collections import Counter

    from miles_aio.metrics import rollout_batch_metrics, token_staleness_histogram

    samples = []
    for i, segments in enumerate(samples_segments):
        s = Sample(group_index=0, index=i, prompt="p", reward=1.0)
        for n, v, trained in segments:
            if trained:
                s.append(out(n, v))
            else:
                s.append_context([1] * n)
        samples.append(s)
    version = max((v for s in samples for v in s.weight_versions if v is not None), default=0) + ahead
    by_version: Counter[int] = Counter()
    for s in samples:
        for v, m in zip(s.weight_versions, s.loss_mask, strict=True):
            if m and v is not None:
                by_version[v] += 1
    total = sum(by_version.values())
    buckets = Counter({k: 0 for k in ("0", "1", "2", "3", "4+")})
    for v, c in by_version.items():
        buckets[("0", "1", "2", "3", "4+")[min(version - v, 4)]] += c
    expected = {f"rollout/token_staleness/{k}": c / total if total else 0.0 for k, c in buckets.items()}
    assert token_staleness_histogram(samples, version=version) == expected
    metrics = rollout_batch_metrics([samples], version=version)
    assert {k: metrics[k] for k in expected} == expected
    tokens = sum(s.response_length for s in samples)
    model_tokens = sum(s.loss_mask.count(1) for s in samples)
    assert metrics["rollout/model_token_ratio"] == (model_tokens / tokens if tokens else 0.0)
    all_known = [v for s in samples for v in s.weight_versions if v is not None]
    if all_known:  # one group: its train staleness is against its oldest token
        assert metrics["rollout/train_staleness_max"] == version - min(all_known)
    else:
        assert "rollout/train_staleness_max" not in metrics  # unknown is absent, not 0
    for s in samples:
        known = [v for v in s.weight_versions if v is not None]
        assert s.oldest_weight_version == (min(known) if known else None)

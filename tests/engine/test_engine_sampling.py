"""The embedded engine's sampler (pure torch, no engine): SGLang's logit processing and logprob rule."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio.engine.sampling import TOP_K_ALL, RowSampling, SamplingParams, sample_batch

pytestmark = pytest.mark.pure

VOCAB = 12


def _row(params: SamplingParams, *, out: list[int] | None = None, seed: int = 0, **kw: object) -> RowSampling:
    return RowSampling(params=params, rng=random.Random(seed), output_ids=out or [], **kw)  # type: ignore[arg-type]


def _reference(
    logits: torch.Tensor, p: SamplingParams, out: list[int], stop_ids: frozenset[int]
) -> torch.Tensor:
    """SGLang's processing written out longhand, for one row."""
    x = logits.clone()
    counts = torch.zeros(VOCAB)
    for t in out:
        counts[t] += 1
    x -= p.frequency_penalty * counts
    x -= p.presence_penalty * (counts > 0).float()
    if len(out) < p.min_new_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    for t in set(out):
        x[t] = x[t] * p.repetition_penalty if x[t] < 0 else x[t] / p.repetition_penalty
    for t, b in p.logit_bias:
        x[t] += b
    return x


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    freq=st.floats(-2, 2),
    pres=st.floats(-2, 2),
    rep=st.floats(0.1, 2.0),
    min_new=st.integers(0, 4),
    out=st.lists(st.integers(0, VOCAB - 1), max_size=6),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5), max_size=3),
    top_n=st.integers(0, 4),
)
def test_logprobs_follow_the_processed_tempered_distribution(
    seed: int,
    temperature: float,
    freq: float,
    pres: float,
    rep: float,
    min_new: int,
    out: list[int],
    bias: dict[int, float],
    top_n: int,
) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed))
    p = SamplingParams(
        temperature=temperature,
        frequency_penalty=freq,
        presence_penalty=pres,
        repetition_penalty=rep,
        min_new_tokens=min_new,
        max_new_tokens=10,
        logit_bias=tuple(sorted(bias.items())),
    )
    stop = frozenset({2, 5})
    [row] = sample_batch(logits, [_row(p, out=out, seed=seed, stop_ids=stop, top_n=top_n, token_ids=(1, 3))])
    ref = _reference(logits[0], p, out, stop)
    ref_lp = torch.log_softmax(ref / (temperature if temperature > 0 else 1.0), dim=-1)
    ref_lp = ref_lp.clamp(min=torch.finfo(torch.float32).min)
    assert abs(row.logprob - float(ref_lp[row.token])) < 1e-4
    if len(out) < min_new:
        assert row.token not in stop
    if temperature == 0.0:
        assert row.token == int(torch.argmax(ref))
    assert row.token_ids is not None
    assert [t for _, t in row.token_ids] == [1, 3]
    assert all(abs(lp - float(ref_lp[t])) < 1e-4 for lp, t in row.token_ids)
    if top_n:
        assert row.top is not None
        assert len(row.top) == top_n
        values = [lp for lp, _ in row.top]
        assert values == sorted(values, reverse=True)
        assert row.logprob <= values[0] + 1e-6
    else:
        assert row.top is None


def test_a_requests_draws_do_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, VOCAB, generator=gen)
    p = SamplingParams(temperature=1.0, top_k=6, top_p=0.9)
    alone = sample_batch(logits[2:3], [_row(p, seed=42)])[0]
    others = [_row(SamplingParams(temperature=t), seed=i) for i, t in enumerate((0.0, 0.7, 1.3, 2.0))]
    batch = sample_batch(logits, [*others[:2], _row(p, seed=42), *others[2:]])
    assert batch[2] == alone


def test_truncation_never_picks_outside_the_support() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    p = SamplingParams(temperature=1.5, top_k=3)
    picks = {sample_batch(logits, [_row(p, seed=s)])[0].token for s in range(200)}
    assert picks <= allowed
    assert len(picks) == 3  # and it does sample all of them
    assert SamplingParams().top_k == TOP_K_ALL

"""--pack-shared-prompts: the packed forward computes what the rows' own forwards compute.

Two levels: the plan's mask and positions give every target exactly its row's context (hypothesis, no
model), and a real HF Llama's log-probs and gradients through the packed forward equal the padded rows'
(sdpa and eager attention), at prompt and response lengths of tens of tokens. Tolerances: float32 sums in
another order; log-probs to 2e-5 (they are ~−3, so that is ~1e-6 relative), gradients to 1e-6.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio.trainer import losses, shared_prefix
from tests.trainer.helpers import VOCAB, tiny_model


def _rows(
    seed: int, *, groups: int, n: int, prompt: tuple[int, int], resp: tuple[int, int]
) -> list[losses.TrainRow]:
    """`groups` prompts × `n` samples (each its own response length, some 0), then two rows whose prompts
    nobody shares; lengths drawn from the ranges."""
    rng = random.Random(seed)
    rows = []
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(*prompt))] for _ in range(groups + 2)]
    owners = [g for g in range(groups) for _ in range(n)] + [groups, groups + 1]
    rng.shuffle(owners)  # a micro-batch need not hold a group's samples next to each other
    for g in owners:
        r = rng.randint(*resp)
        tokens = prompts[g] + [rng.randrange(3, VOCAB) for _ in range(r)]
        rows.append(
            losses.TrainRow(
                tokens=torch.tensor(tokens),
                response_length=r,
                loss_mask=torch.ones(r),
                rollout_logp=torch.zeros(r),
                advantage=rng.gauss(0.0, 1.0),
            )
        )
    return rows


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    groups=st.integers(1, 4),
    n=st.integers(1, 5),
    prompt=st.integers(1, 6),
    resp=st.integers(0, 6),
)
def test_every_target_sees_exactly_its_rows_context(
    seed: int, groups: int, n: int, prompt: int, resp: int
) -> None:
    """For each row's target t, the packed position predicting it holds the row's token t at the row's
    position t, and attends to exactly the row's tokens 0..t at positions 0..t."""
    rows = _rows(seed, groups=groups, n=n, prompt=(1, prompt), resp=(0, resp))
    mb = losses.collate(rows)
    packing = shared_prefix.plan(mb.input_ids, mb.attention_mask, mb.prompt_lengths)
    if packing is None:  # only when every prompt is its own
        assert len({tuple(r.tokens[: r.tokens.numel() - r.response_length].tolist()) for r in rows}) == len(
            rows
        )
        return
    for i, row in enumerate(rows):
        g, length = int(packing.group[i]), row.tokens.numel()
        for t in range(length - 1):
            q = int(packing.index[i, t])
            assert int(packing.input_ids[g, q]) == int(row.tokens[t])
            assert int(packing.position_ids[g, q]) == t
            keys = packing.allowed[g, 0, q].nonzero().flatten().tolist()
            seen = sorted((int(packing.position_ids[g, k]), int(packing.input_ids[g, k])) for k in keys)
            assert seen == [(k, int(row.tokens[k])) for k in range(t + 1)]
    # every packed row attends somewhere (a query with no key makes sdpa return NaN)
    assert packing.allowed.any(-1).all()


def test_no_shared_prompt_no_packing() -> None:
    rows = _rows(0, groups=0, n=0, prompt=(3, 5), resp=(1, 3))
    mb = losses.collate(rows)
    assert shared_prefix.plan(mb.input_ids, mb.attention_mask, mb.prompt_lengths) is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("pack") / "model")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_the_rows_forward(model_dir: Path, attn: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=attn
    )
    rows = _rows(1, groups=4, n=6, prompt=(20, 60), resp=(0, 40))
    mb = losses.collate(rows)
    packing = shared_prefix.plan(mb.input_ids, mb.attention_mask, mb.prompt_lengths)
    assert packing is not None
    assert packing.input_ids.numel() < mb.input_ids.numel() / 2  # the point: far fewer tokens forwarded

    def logp_and_grads(packed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if packed:
            mask = packing.attention_mask(None if attn == "sdpa" else torch.float32)
            out = model(input_ids=packing.input_ids, attention_mask=mask, position_ids=packing.position_ids)
            logits = shared_prefix.unpack(out.logits, packing)
        else:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
        logp = losses.token_log_probs(logits, mb.targets)
        (-(logp * mb.mask * mb.advantages).sum() / mb.mask.sum()).backward()
        return logp.detach() * mb.mask, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    rows_logp, rows_grads = logp_and_grads(packed=False)
    packed_logp, packed_grads = logp_and_grads(packed=True)
    assert mb.mask.sum() > 300
    torch.testing.assert_close(packed_logp, rows_logp, atol=2e-5, rtol=0)
    assert len(packed_grads) == len(rows_grads) == len(list(model.parameters()))
    assert max(g.abs().max().item() for g in rows_grads) > 1e-3  # a real gradient to compare
    for got, want in zip(packed_grads, rows_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_packing_refuses_what_a_custom_mask_would_change() -> None:
    """Flash attention takes no custom mask; a sliding window would silently become full attention."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from miles_aio.errors import ConfigError
    from miles_aio.trainer.backend import _check_packable

    _check_packable(LlamaConfig(), "sdpa")
    _check_packable(Qwen2Config(use_sliding_window=False), "eager")
    with pytest.raises(ConfigError, match="flash_attention_2 attention takes no custom") as e:
        _check_packable(LlamaConfig(), "flash_attention_2")
    assert e.value.flags == ("--pack-shared-prompts",)
    with pytest.raises(ConfigError, match="sliding-window"):
        _check_packable(MistralConfig(sliding_window=4096), "sdpa")
    with pytest.raises(ConfigError, match="sliding-window"):
        _check_packable(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0), "sdpa")

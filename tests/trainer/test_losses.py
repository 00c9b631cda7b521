"""The RL math against values computed by hand on tiny tensors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio.trainer import losses
from miles_aio.trainer.losses import LossSettings, TrainRow
from tests.trainer.helpers import make_batch

pytestmark = [pytest.mark.pure, pytest.mark.timeout(30)]
LN = math.log


# -- advantages --------------------------------------------------------------------------------------------
def test_grpo_mean_centres_and_divides_by_unbiased_std() -> None:
    (adv,) = losses.compute_advantages([[1.0, 0.0, 0.0, 1.0]], "grpo")
    # mean 0.5, unbiased std sqrt(4 · 0.25 / 3) = 0.57735
    assert adv == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)


def test_dr_grpo_only_centres() -> None:
    (adv,) = losses.compute_advantages([[1.0, 0.0, 0.0, 1.0]], "grpo", std_normalization=False)
    assert adv == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_group_of_one_keeps_its_raw_reward() -> None:
    assert losses.compute_advantages([[0.7]], "grpo") == [[pytest.approx(0.7)]]


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    (adv,) = losses.compute_advantages([[1.0, 0.0, 0.0]], "rloo")
    assert adv == pytest.approx([1.0, -0.5, -0.5])  # 1 − mean(0, 0); 0 − mean(1, 0)


def test_reinforce_pp_baseline_centres_per_group_then_whitens_the_batch() -> None:
    adv = losses.compute_advantages([[1.0, 0.0], [1.0, 1.0]], "reinforce_plus_plus_baseline")
    # centred: [0.5, −0.5], [0, 0]; batch mean 0, unbiased std sqrt(0.5 / 3) = 0.408248
    assert adv[0] == pytest.approx([1.224745, -1.224745], abs=1e-5)
    assert adv[1] == pytest.approx([0.0, 0.0], abs=1e-6)


def test_scalar_reward_reads_dict_rewards_by_key() -> None:
    assert losses.scalar_reward({"acc": 1, "len": 3}, "acc") == 1.0
    with pytest.raises(ValueError, match="--reward-key"):
        losses.scalar_reward({"acc": 1}, None)
    with pytest.raises(ValueError, match="no reward"):
        losses.scalar_reward(None, None)


# -- per-token quantities ----------------------------------------------------------------------------------
def test_token_log_probs_and_entropy() -> None:
    logits = torch.tensor([[[0.0, LN(3)]]])  # probs 0.25, 0.75
    assert losses.token_log_probs(logits, torch.tensor([[1]])).item() == pytest.approx(LN(0.75))
    assert losses.entropy_from_logits(logits).item() == pytest.approx(
        -(0.25 * LN(0.25) + 0.75 * LN(0.75)), abs=1e-6
    )


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("k1", LN(2)), ("k2", 0.5 * LN(2) ** 2), ("k3", 0.5 - 1 + LN(2)), ("low_var_kl", 0.5 - 1 + LN(2))],
)
def test_kl_estimators(kind: losses.KLType, expected: float) -> None:
    logp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])  # r = π/π_ref = 2
    assert losses.kl_estimate(logp, ref, kind).item() == pytest.approx(expected, abs=1e-6)


def test_low_var_kl_is_clamped() -> None:
    logp, ref = torch.tensor([0.0]), torch.tensor([20.0])
    assert losses.kl_estimate(logp, ref, "low_var_kl").item() == 10.0
    assert losses.kl_estimate(logp, ref, "k3").item() > 1e8


def test_ppo_clip_dual_bounds() -> None:
    logp = torch.log(torch.tensor([1.5, 1.5, 1.5, 0.5]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped, ratio = losses.ppo_clip_loss(logp, old, adv, eps_clip=0.2)
    # r=1.5,A=+1: max(−1.5, −1.2) = −1.2 (clipped); A=−1: max(1.5, 1.2) = 1.5; r=0.5,A=−1: max(.5, .8) = .8
    assert loss.tolist() == pytest.approx([-1.2, 1.5, -1.2, 0.8])
    assert clipped.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert ratio.tolist() == pytest.approx([1.5, 1.5, 1.5, 0.5])
    high, _, _ = losses.ppo_clip_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    assert high.tolist() == pytest.approx([-1.28, 1.5, -1.28, 0.8])


def test_tis_weight_is_clamped_and_detached() -> None:
    old = torch.log(torch.tensor([3.0, 0.5, 0.5])).requires_grad_()
    w = losses.tis_weights(old, torch.zeros(3), low=0.0, high=2.0)
    assert w.tolist() == pytest.approx([2.0, 0.5, 0.5])
    assert not w.requires_grad
    assert losses.tis_weights(old, torch.zeros(3), low=0.6, high=2.0).tolist() == pytest.approx(
        [2.0, 0.6, 0.6]
    )


# -- the loss ----------------------------------------------------------------------------------------------
def _loss(settings: LossSettings, **kw: torch.Tensor | float) -> losses.LossOutput:
    # Two tokens of one sequence (+1 masked); π = π_old (ratio 1); π_old/π_rollout = 3 and 0.5.
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_()
    args: dict[str, object] = {
        "logp": logp,
        "mask": torch.tensor([[1.0, 1.0, 0.0]]),
        "advantages": torch.tensor([[2.0, 2.0, 2.0]]),
        "old_logp": logp.detach().clone(),
        "rollout_logp": logp.detach() - torch.log(torch.tensor([[3.0, 0.5, 1.0]])),
        "settings": settings,
    }
    args.update(kw)
    return losses.policy_loss(**args)  # type: ignore[arg-type]


def test_plain_ppo_token_mean() -> None:
    out = _loss(LossSettings())
    assert out.loss.item() == pytest.approx(-2.0)  # −A·r averaged over the 2 masked tokens
    m = losses.finalize_metrics(out.sums, out.maxes)
    assert m["tokens"] == 2 and m["pg_clipfrac"] == 0.0 and m["ratio"] == pytest.approx(1.0)
    assert m["train_rollout_logp_abs_diff"] == pytest.approx((LN(3) + LN(2)) / 2)
    # k3 of KL(rollout‖old): mean of (x − 1 − ln x) for x = 3, 0.5
    assert m["train_rollout_kl"] == pytest.approx(((3 - 1 - LN(3)) + (0.5 - 1 - LN(0.5))) / 2)
    assert m["train_rollout_logp_abs_diff_max"] == pytest.approx(LN(3))


def test_global_token_normaliser() -> None:
    out = _loss(LossSettings(), num_tokens=8.0)
    assert out.loss.item() == pytest.approx(-2.0 * 2 / 8)


def test_tis_scales_each_token_by_its_truncated_weight() -> None:
    out = _loss(LossSettings(use_tis=True, tis_clip=2.0))
    assert out.loss.item() == pytest.approx(-(2 * 2.0 + 2 * 0.5) / 2)  # weights clamp(3)=2 and 0.5
    m = losses.finalize_metrics(out.sums, out.maxes)
    assert m["tis_weight"] == pytest.approx(1.25) and m["tis_weight_max"] == pytest.approx(2.0)
    assert m["tis_clipfrac"] == pytest.approx(0.5)
    # gradient wrt log π: −A·r·w/N per token (r = 1), w detached
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_()
    out = _loss(LossSettings(use_tis=True), logp=logp, old_logp=logp.detach().clone())
    torch.autograd.backward(out.loss)
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-2.0, -0.5, 0.0])


def test_decoupled_weight_is_untruncated_unless_tis() -> None:
    assert _loss(LossSettings(use_decoupled_loss=True)).loss.item() == pytest.approx(-(2 * 3 + 2 * 0.5) / 2)
    both = LossSettings(use_decoupled_loss=True, use_tis=True, tis_clip=2.0, tis_clip_low=0.6)
    assert _loss(both).loss.item() == pytest.approx(-(2 * 2.0 + 2 * 0.6) / 2)


def test_decoupled_clips_against_the_proximal_policy() -> None:
    # π/π_prox = 1.5 (clipped to 1.2 for A > 0), behaviour weight π_prox/π_behave = 2
    logp = torch.log(torch.tensor([[0.6]]))
    prox = torch.log(torch.tensor([[0.4]]))
    out = losses.policy_loss(
        logp=logp,
        mask=torch.ones(1, 1),
        advantages=torch.ones(1, 1),
        old_logp=prox,
        rollout_logp=prox - LN(2),
        settings=LossSettings(use_decoupled_loss=True),
    )
    assert out.loss.item() == pytest.approx(-1.2 * 2)
    assert out.sums["pg_clipfrac"] == 1.0


def test_kl_and_entropy_terms() -> None:
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.25]]))
    settings = LossSettings(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01)
    out = _loss(settings, ref_logp=ref, entropy=torch.tensor([[1.0, 2.0, 9.0]]))
    kl = (LN(0.5 / 0.25) + 0.0) / 2  # k1 per token: ln 2 and 0
    assert out.loss.item() == pytest.approx(-2.0 + 0.1 * kl - 0.01 * 1.5)
    m = losses.finalize_metrics(out.sums, out.maxes)
    assert m["kl_loss"] == pytest.approx(kl) and m["entropy"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="ref_logp"):
        _loss(settings, entropy=torch.zeros(1, 3))


def test_opsm_masks_negative_advantage_sequences_that_drifted() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.9, 0.9], [0.9, 0.9]]))  # KL estimate ln(1.8) > delta
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])
    out = losses.policy_loss(
        logp=logp,
        mask=torch.ones(2, 2),
        advantages=adv,
        old_logp=logp,
        rollout_logp=rollout,
        settings=LossSettings(use_opsm=True, opsm_delta=0.1),
    )
    assert out.sums["opsm_masked_seqs"] == 1.0 and out.sums["tokens"] == 2.0
    assert out.loss.item() == pytest.approx(-1.0)  # only the positive-advantage row remains


def test_old_logp_none_is_this_forwards_own_log_probs() -> None:
    """One optimizer step per rollout: π_old is the policy the logits come from, so `old_logp=None`
    (no separate forward) gives the loss, gradients and metrics a recomputed π_old would, TIS included."""
    mb = losses.collate([_row([5, 6, 7, 8], 2, adv=1.5), _row([9, 10, 11], 1, adv=-1.0)])
    settings = LossSettings(use_tis=True)
    base = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    outs, grads = [], []
    for fused in (True, False):
        logits = base.clone().requires_grad_()
        old = None if fused else losses.token_log_probs(logits, mb.targets).detach()
        out = losses.micro_batch_loss(logits, mb, old_logp=old, settings=settings, num_tokens=3.0)
        out.loss.backward()
        outs.append(out)
        assert logits.grad is not None
        grads.append(logits.grad)
    assert outs[0].loss.item() == outs[1].loss.item() != 0.0
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert outs[0].sums == outs[1].sums and outs[0].sums["pg_clipfrac"] == 0.0


# -- batching ----------------------------------------------------------------------------------------------
def _row(tokens: list[int], r: int, adv: float = 1.0, step: int = 0) -> TrainRow:
    return TrainRow(torch.tensor(tokens), r, torch.ones(r), -torch.arange(1.0, r + 1.0), adv, step)


def test_collate_aligns_response_tokens_to_targets() -> None:
    mb = losses.collate([_row([5, 6, 7, 8], 2), _row([9, 10, 11], 1, adv=-1.0)])
    assert mb.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mb.targets.tolist() == [[6, 7, 8], [10, 11, 0]]
    assert mb.mask.tolist() == [[0, 1, 1], [0, 1, 0]]  # targets 7, 8 and 11
    assert mb.rollout_logp.tolist() == [[0, -1, -2], [0, -1, 0]]
    assert mb.advantages[1, 1].item() == -1.0
    assert mb.masked_out().mask.sum().item() == 0
    with pytest.raises(ValueError, match="prompt token"):
        losses.collate([_row([5, 6], 2)])


def test_split_micro_batches_by_count_and_by_tokens() -> None:
    rows = [_row([1] * n, 1) for n in (4, 4, 8, 2, 2)]
    assert [len(m) for m in losses.split_micro_batches(rows, micro_batch_size=2)] == [2, 2, 1]
    packed = losses.split_micro_batches(rows, micro_batch_size=1, max_tokens=8)
    assert [[int(r.tokens.numel()) for r in m] for m in packed] == [[4, 4], [8], [2, 2]]


def test_shard_batch_splits_steps_then_dp_ranks() -> None:
    batch = make_batch(0, groups=2, n=4)
    out = losses.shard_batch(
        batch, estimator="grpo", std_normalization=True, reward_key=None, global_batch_size=4, dp_size=2
    )
    flat = [s for g in batch for s in g]
    assert [[r.opt_step for r in shard] for shard in out.shards] == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert out.shards[0][2].tokens.tolist() == flat[4].tokens  # step 1 starts at sample 4; rank 0 first
    assert out.shards[1][0].tokens.tolist() == flat[2].tokens
    assert out.num_tokens == [
        sum(s.response_length for s in flat[:4]),
        sum(s.response_length for s in flat[4:]),
    ]
    assert len(out.advantages) == 8


@settings(max_examples=200, deadline=None)
@given(
    ints=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=50),
    floats=st.lists(st.floats(allow_nan=False, width=64), max_size=50),
)
def test_tensor_of_equals_torch_tensor(ints: list[int], floats: list[float]) -> None:
    """The fast list → tensor path gives torch.tensor's values, dtypes and float32 rounding (and empties)."""
    for values, dtype in ((ints, torch.int64), (floats, torch.float32), ([1, 0, 1], torch.float32)):
        fast, slow = losses.tensor_of(values, dtype), torch.tensor(values, dtype=dtype)
        assert fast.dtype == slow.dtype and fast.shape == slow.shape
        assert torch.equal(fast, slow)


def test_tensor_of_refuses_what_torch_refuses() -> None:
    with pytest.raises(TypeError):
        losses.tensor_of([1, None, 3], torch.int64)  # type: ignore[list-item]


def test_mask_offpolicy_keeps_only_the_newest_versions_tokens() -> None:
    """--mask-offpolicy-in-partial-rollout: a response that spanned pushes trains only on the tokens its
    newest policy produced; the loss denominator counts what is left."""
    batch = make_batch(0, groups=1, n=2)
    spanning, whole = batch[0]
    r = spanning.response_length
    assert r > 1
    spanning.weight_versions = [*([3] * (r - 1)), 4]  # one push landed before its last token
    spanning.loss_mask = [1] * r
    whole.weight_versions = [4] * whole.response_length
    assert losses.newest_version_mask(spanning) == [0] * (r - 1) + [1]
    tool = make_batch(1, groups=1, n=1)[0][0]  # a context token (loss mask 0, no version) stays 0
    tool.weight_versions = [None] + [5] * (tool.response_length - 1)
    tool.loss_mask = [0] + [1] * (tool.response_length - 1)
    assert losses.newest_version_mask(tool) == tool.loss_mask
    kw: dict[str, Any] = {"estimator": "grpo", "std_normalization": True, "reward_key": None, "dp_size": 1}
    out = losses.shard_batch(batch, global_batch_size=2, mask_offpolicy=True, **kw)
    assert out.shards[0][0].loss_mask.tolist() == [0.0] * (r - 1) + [1.0]
    assert out.num_tokens == [1 + whole.response_length] and out.masked_offpolicy == r - 1
    plain = losses.shard_batch(batch, global_batch_size=2, **kw)
    assert plain.num_tokens == [r + whole.response_length] and plain.masked_offpolicy == 0

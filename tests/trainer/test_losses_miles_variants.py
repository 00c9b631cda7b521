"""miles' loss and advantage variants against values computed by hand on tiny tensors: dual-clip PPO
(--eps-clip-c), GSPO's sequence ratio, REINFORCE++ token returns with --kl-coef shaping, masked
whitening (--normalize-advantages), a monitoring-only KL (--kl-loss-coef 0) and the lr schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import structlog
import torch

from miles_aio.config import log_config_warnings
from miles_aio.errors import ConfigError
from miles_aio.trainer import losses
from miles_aio.trainer.config import TrainConfig, with_run_lr_decay
from miles_aio.trainer.losses import LossSettings
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(30)
LN = math.log


def _loss(
    settings: LossSettings, logp: torch.Tensor, adv: torch.Tensor, *, ref_logp: torch.Tensor | None = None
) -> losses.LossOutput:
    old = torch.zeros_like(logp)
    return losses.policy_loss(
        logp=logp,
        mask=torch.ones_like(logp),
        advantages=adv,
        old_logp=old,
        rollout_logp=old.clone(),
        settings=settings,
        ref_logp=ref_logp,
    )


# -- dual clip ---------------------------------------------------------------------------------------------
def test_dual_clip_bounds_negative_advantage_tokens_only() -> None:
    # ratios 4, 2, 4, 0.5 with A = −1, −1, +1, −1; eps 0.2, c = 3:
    #   A<0, r=4: PPO max(4, 1.2) = 4 → bounded to −A·c = 3 (dual clip active)
    #   A<0, r=2: max(2, 1.2) = 2 < 3 (unchanged);  A>0, r=4: max(−4, −1.2) = −1.2 (A>0: never bounded)
    #   A<0, r=0.5: max(0.5, 0.8) = 0.8 (unchanged)
    logp = torch.log(torch.tensor([[4.0, 2.0, 4.0, 0.5]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    out = _loss(LossSettings(eps_clip_c=3.0), logp, adv)
    assert out.loss.item() == pytest.approx((3 + 2 - 1.2 + 0.8) / 4)
    assert out.sums["dual_clipfrac"] == 1.0  # one token of four
    assert losses.finalize_metrics(out.sums, out.maxes)["dual_clipfrac"] == pytest.approx(0.25)
    out.loss.backward()
    assert logp.grad is not None
    # the bounded token is a constant; the r=2 token's loss is −A·r = r, d/dlogp = r = 2, over 4 tokens
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.5, 0.0, 0.0])


def test_no_dual_clip_metric_without_the_flag() -> None:
    out = _loss(LossSettings(), torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]))
    assert "dual_clipfrac" not in out.sums


def test_dual_clip_function_directly() -> None:
    pg, active = losses.dual_clip(torch.tensor([5.0, 1.0, 5.0]), torch.tensor([-1.0, -1.0, 2.0]), 3.0)
    assert pg.tolist() == [3.0, 1.0, 5.0]
    assert active.tolist() == [1.0, 0.0, 0.0]


# -- GSPO --------------------------------------------------------------------------------------------------
def test_gspo_advantages_are_grpo_advantages() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.4]]
    assert losses.compute_advantages(rewards, "gspo") == losses.compute_advantages(rewards, "grpo")


def test_gspo_ratio_is_the_sequence_geometric_mean_and_ignores_masked_tokens() -> None:
    logp = torch.tensor([[LN(2.0), 0.0], [LN(2.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    log_s = losses.gspo_log_ratio(logp, torch.zeros(2, 2), mask)
    # row 0: mean(ln 2, 0) = ln √2 on both tokens; row 1: only the first token counts → ln 2
    assert log_s.exp()[0].tolist() == pytest.approx([math.sqrt(2), math.sqrt(2)])
    assert log_s.exp()[1, 0].item() == pytest.approx(2.0)


def test_gspo_clips_per_sequence() -> None:
    # s = √2 > 1 + 0.28: every token of the sequence is clipped to −A·1.28 and carries no gradient.
    logp = torch.tensor([[LN(2.0), 0.0]], requires_grad=True)
    out = _loss(LossSettings(advantage_estimator="gspo", eps_clip_high=0.28), logp, torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(-1.28)
    assert out.sums["pg_clipfrac"] == 2.0
    assert out.sums["ratio"] == pytest.approx(2 * math.sqrt(2))
    out.loss.backward()
    assert logp.grad is not None and logp.grad.abs().max().item() == 0.0


def test_gspo_gradient_gives_every_token_the_sequence_ratio() -> None:
    # s = √1.1 = 1.0488 (inside the clip): loss = mean_t(−A·s); d/dlogp_t = −A·s/2 for *both* tokens,
    # where token-level PPO would give −1.1/2 and −1/2.
    s = math.sqrt(1.1)
    logp = torch.tensor([[LN(1.1), 0.0]], requires_grad=True)
    out = _loss(LossSettings(advantage_estimator="gspo"), logp, torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(-s)
    assert out.sums["pg_clipfrac"] == 0.0
    out.loss.backward()
    assert logp.grad is not None and logp.grad.tolist()[0] == pytest.approx([-s / 2, -s / 2])

    ppo = torch.tensor([[LN(1.1), 0.0]], requires_grad=True)
    _loss(LossSettings(), ppo, torch.ones(1, 2)).loss.backward()
    assert ppo.grad is not None and ppo.grad.tolist()[0] == pytest.approx([-1.1 / 2, -0.5])


def test_gspo_with_tis_keeps_the_per_token_behaviour_weight() -> None:
    # π_old/π_rollout = 3 on token 0 (clamped to 2), 1 on token 1; s = 1 (logp = old): pg = −A·1·w.
    old = torch.tensor([[LN(3.0), 0.0]])
    out = losses.policy_loss(
        logp=old.clone(),
        mask=torch.ones(1, 2),
        advantages=torch.ones(1, 2),
        old_logp=old,
        rollout_logp=torch.zeros(1, 2),
        settings=LossSettings(advantage_estimator="gspo", use_tis=True, tis_clip=2.0),
    )
    assert out.loss.item() == pytest.approx((-2.0 - 1.0) / 2)


# -- REINFORCE++ ---------------------------------------------------------------------------------------------
def test_reinforce_pp_advantages_pass_the_raw_reward_through() -> None:
    assert losses.compute_advantages([[1.0, 0.0], [0.5]], "reinforce_plus_plus") == [[1.0, 0.0], [0.5]]


def test_reinforce_pp_returns_sum_kl_shaped_rewards_from_each_token() -> None:
    # target 0 is a prompt position (mask 0); reward 1 on the last response token; kl_coef 0.5:
    # token rewards [·, −0.05, −0.1, 1 − 0.15] → returns (γ = 1) [0, 0.70, 0.75, 0.85]
    rewards = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    kl = torch.tensor([[9.0, 0.1, 0.2, 0.3]])
    ret = losses.reinforce_pp_returns(rewards, mask, kl=kl, kl_coef=0.5)
    assert ret.tolist()[0] == pytest.approx([0.0, 0.70, 0.75, 0.85])


def test_reinforce_pp_reward_sits_on_the_last_trained_token() -> None:
    # mask [1, 0, 1, 0]: the reward 2 lands on index 2; masked tokens return 0; an empty row stays 0
    rewards = torch.tensor([[2.0, 2.0, 2.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ret = losses.reinforce_pp_returns(rewards, mask)
    assert ret.tolist() == [[2.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="KL"):
        losses.reinforce_pp_returns(rewards, mask, kl_coef=0.1)


# -- whitening -----------------------------------------------------------------------------------------------
def test_masked_whiten_uses_masked_entries_only() -> None:
    # [1, 2, 3] (99 masked out): mean 2, unbiased var 1 → [−1, 0, 1], masked entry 0
    (w,) = losses.masked_whiten([torch.tensor([1.0, 2.0, 3.0, 99.0])], [torch.tensor([1.0, 1.0, 1.0, 0.0])])
    assert w.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)


def test_masked_whiten_spans_tensors_and_ranks() -> None:
    values = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]])]
    masks = [torch.ones(1, 2), torch.ones(1, 1)]

    def two_identical_ranks(stats: torch.Tensor) -> torch.Tensor:
        return stats * 2  # what an all-reduce sum over two ranks holding the same rows returns

    a, b = losses.masked_whiten(values, masks, reduce=two_identical_ranks)
    # six values {1,1,2,2,3,3}: mean 2, unbiased var (4·1)/5 = 0.8
    scale = 1 / math.sqrt(0.8 + 1e-8)
    assert a.tolist()[0] == pytest.approx([-scale, 0.0])
    assert b.tolist()[0] == pytest.approx([scale])


# -- KL for monitoring only ----------------------------------------------------------------------------------
def test_kl_loss_coef_zero_logs_the_kl_without_changing_the_loss() -> None:
    logp = torch.tensor([[LN(0.5)]], requires_grad=True)
    ref = torch.tensor([[LN(0.25)]])
    plain = _loss(LossSettings(), logp, torch.ones(1, 1))
    watched = _loss(LossSettings(use_kl_loss=True, kl_loss_coef=0.0), logp, torch.ones(1, 1), ref_logp=ref)
    assert watched.loss.item() == pytest.approx(plain.loss.item())
    assert watched.sums["kl_loss"] == pytest.approx(0.5 - 1 + LN(2), abs=1e-6)  # low_var_kl, r = 2
    watched.loss.backward()
    assert logp.grad is not None and logp.grad.item() == pytest.approx(-0.5)  # d(−A·r)/dlogp = −r, r = 0.5/1


# -- config --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        ({"eps_clip_c": 1.0}, ["--eps-clip-c"]),
        ({"eps_clip_c": 0.5}, ["--eps-clip-c"]),
        ({"kl_coef": 0.1}, ["--kl-coef", "--advantage-estimator"]),
        ({"kl_coef": 0.1, "advantage_estimator": "gspo"}, ["--kl-coef", "--advantage-estimator"]),
        ({"kl_coef": -0.1, "advantage_estimator": "reinforce_plus_plus"}, ["--kl-coef"]),
        ({"lr_decay_style": "step"}, ["--lr-decay-style"]),
        ({"lr_warmup_iters": -1}, ["--lr-warmup-iters"]),
        ({"lr_decay_iters": 0}, ["--lr-decay-iters"]),
        ({"lr_decay_iters": 5, "lr_warmup_iters": 5}, ["--lr-decay-iters", "--lr-warmup-iters"]),
        ({"min_lr": 1e-3, "lr": 1e-4}, ["--min-lr", "--lr"]),
        ({"decoupled_lr": -1e-3}, ["--decoupled-lr"]),
        ({"decoupled_lr": float("nan")}, ["--decoupled-lr"]),
        ({"decoupled_min_lr": 1e-5}, ["--decoupled-min-lr", "--decoupled-lr"]),
        ({"decoupled_lr": 1e-3, "decoupled_min_lr": 1e-2}, ["--decoupled-lr", "--decoupled-min-lr"]),
        ({"decoupled_lr": 1e-5, "lr": 1e-3, "min_lr": 1e-4}, ["--decoupled-lr", "--min-lr"]),
    ],
)
def test_new_flags_validate_and_name_themselves(kwargs: dict[str, object], flags: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)  # type: ignore[arg-type]
    assert set(flags) <= set(info.value.flags)


def test_new_flags_accept_miles_recipes() -> None:
    assert not TrainConfig(use_kl_loss=False).needs_ref_model
    assert TrainConfig(use_kl_loss=True, kl_loss_coef=0.0).needs_ref_model  # monitoring only
    cfg = TrainConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.01, normalize_advantages=True)
    assert cfg.needs_ref_model
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    TrainConfig(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4, use_tis=True, eps_clip_c=3.0)
    TrainConfig(advantage_estimator="gspo", use_decoupled_loss=True, use_opsm=True)
    decoupled = TrainConfig(
        lr=1e-4, min_lr=1e-5, decoupled_lr=1e-3, lr_decay_style="cosine", lr_decay_iters=10
    )
    assert TrainConfig.from_json(decoupled.to_json()) == decoupled
    # Megatron's default: the decoupled decay ends at --min-lr; without --decoupled-lr one lr for all
    assert decoupled.lr_at(10, decoupled=True) == pytest.approx(1e-5)
    assert decoupled.lr_at(0, decoupled=True) == pytest.approx(1e-3) and decoupled.lr_at(0) == pytest.approx(
        1e-4
    )
    assert TrainConfig(lr=1e-4).lr_at(3, decoupled=True) == pytest.approx(1e-4)


def test_many_steps_per_rollout_warns() -> None:
    with structlog.testing.capture_logs() as logs:
        TrainConfig(num_steps_per_rollout=2)  # validation never logs: the controller process does, once
        log_config_warnings(make_config(num_steps_per_rollout=1))
        assert not logs
        log_config_warnings(make_config(num_steps_per_rollout=2))
    assert [e["event"] for e in logs] == ["num_steps_per_rollout_adds_off_policyness"]
    assert logs[0]["log_level"] == "warning"


def test_lr_schedule_follows_megatron() -> None:
    lin = TrainConfig(lr=1.0, min_lr=0.2, lr_warmup_iters=2, lr_decay_iters=6, lr_decay_style="linear")
    # warmup k/2; then ρ = (k − 2)/4, lr = 0.2 + 0.8·(1 − ρ); min_lr past step 6
    assert [lin.lr_at(k) for k in range(8)] == pytest.approx([0.0, 0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    cos = TrainConfig(lr=1.0, min_lr=0.2, lr_warmup_iters=2, lr_decay_iters=6, lr_decay_style="cosine")
    # ρ = 1/4, 1/2: 0.2 + 0.8·½(1 + cos πρ)
    assert cos.lr_at(3) == pytest.approx(0.2 + 0.4 * (1 + math.cos(math.pi / 4)))
    assert cos.lr_at(4) == pytest.approx(0.6)
    assert cos.lr_at(6) == pytest.approx(0.2) and cos.lr_at(60) == pytest.approx(0.2)
    const = TrainConfig(lr=1.0, lr_warmup_iters=4, min_lr=0.1)
    assert [const.lr_at(k) for k in (0, 2, 4, 100)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    assert TrainConfig(lr=0.3).lr_at(0) == 0.3  # default: constant, no warmup


def test_decay_iters_default_to_the_whole_run_as_megatron() -> None:
    """--lr-decay-iters unset: the decay ends at the run's last optimizer step (Megatron: train_iters),
    resolved when the trainer starts from the run it trains (never baked into a config copy)."""
    # 4 groups × 4 samples per rollout, global batch 8: 2 optimizer steps per rollout, 5 rollouts
    cfg = make_config(
        num_rollout=5,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        global_batch_size=8,
        lr=1.0,
        lr_decay_style="linear",
        lr_warmup_iters=2,
    )
    assert cfg.train.lr_decay_iters is None
    train = with_run_lr_decay(cfg.train, num_rollout=5, samples_per_step=16)
    assert train.lr_decay_iters == 10
    assert train.lr_at(10) == pytest.approx(0.0) and train.lr_at(6) == pytest.approx(0.5)
    assert with_run_lr_decay(cfg.train, num_rollout=20, samples_per_step=16).lr_decay_iters == 40
    given = make_config(lr_decay_style="linear", lr_decay_iters=7).train
    assert with_run_lr_decay(given, num_rollout=50, samples_per_step=4).lr_decay_iters == 7  # as given
    constant = make_config().train
    assert with_run_lr_decay(constant, num_rollout=5, samples_per_step=4).lr_decay_iters is None
    make_config(num_rollout=0, lr_decay_style="cosine", lr_warmup_iters=3)  # nothing to train: fine
    with pytest.raises(ConfigError) as info:
        make_config(num_rollout=3, lr_decay_style="cosine", lr_warmup_iters=3)
    assert "--lr-warmup-iters" in str(info.value) and "--num-rollout" in str(info.value)


def test_decoupled_lr_groups_a_tied_embedding_once(tmp_path: Path) -> None:
    """The HF backend's groups: with --decoupled-lr the embedding and lm_head form group 1 — a tied model's
    one shared tensor once — and every other weight group 0; without it one group holds everything."""
    from transformers import AutoModelForCausalLM

    from miles_aio.models.tiny import build_tiny_llama
    from miles_aio.trainer.backend import adamw

    for tied in (False, True):
        path = build_tiny_llama(
            tmp_path / str(tied), alphabet="0123456789", hidden_size=32, num_heads=2, num_kv_heads=1,
            tie_word_embeddings=tied,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(str(path))
        params = list(model.parameters())
        ends = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
        groups = adamw(TrainConfig(lr=1e-4, decoupled_lr=1e-3), params, decoupled=ends).param_groups
        assert [g["decoupled"] for g in groups] == [False, True]
        assert {id(p) for p in groups[1]["params"]} == {id(p) for p in ends}
        assert len(groups[1]["params"]) == (1 if tied else 2)
        assert sum(len(g["params"]) for g in groups) == len(params)
        assert len(adamw(TrainConfig(lr=1e-4), params, decoupled=ends).param_groups) == 1

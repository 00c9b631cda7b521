"""The RL math of a training step, as pure torch functions (no distributed, no model).

Consumes rewards (per group), logits and per-token log-probs of four policies: π (current, with grad),
π_old (recomputed before the update = the proximal policy, or the engine's when
`--use-rollout-logprobs`), π_rollout (the engine that sampled, i.e. the behaviour policy) and π_ref
(frozen initial model, only with `--use-kl-loss`). Produces per-sample advantages and one scalar loss
per micro-batch plus token-summed metrics.

Token tensors are [B, T] and aligned to *targets*: entry (b, i) is about token i+1 of row b, predicted
from logits at position i. `mask` is 1 on trained response tokens. The loss is summed over masked
tokens and divided by `num_tokens`, the masked-token count of the whole global batch (all micro-batches
and data-parallel ranks), so gradient accumulation and data parallelism give the same update as one big
batch: a token mean over the global batch.
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import torch
import torch.nn.functional as F

from miles_aio.trainer.config import AdvantageEstimator, KLLossType
from miles_aio.types import Sample, scalar_reward

__all__ = [
    "LossOutput",
    "LossSettings",
    "MicroBatch",
    "StepShards",
    "TrainRow",
    "collate",
    "compute_advantages",
    "dual_clip",
    "entropy_from_logits",
    "finalize_metrics",
    "gspo_log_ratio",
    "kl_estimate",
    "masked_whiten",
    "micro_batch_loss",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_pp_returns",
    "scalar_reward",
    "shard_batch",
    "split_micro_batches",
    "tensor_of",
    "tis_weights",
    "token_log_probs",
]

Estimator = AdvantageEstimator  # the flags' own types: one list of names
KLType = KLLossType


# -- advantages ------------------------------------------------------------------------------------------
def compute_advantages(
    rewards: Sequence[Sequence[float]],
    estimator: Estimator,
    *,
    std_normalization: bool = True,
    eps: float = 1e-6,
    post_processed: bool = False,
) -> list[list[float]]:
    """Per-sample advantages for a step's groups (one list of rewards per prompt group).

    `post_processed`: the rewards come from --custom-reward-post-process-path, which replaces the group
    normalization: grpo/gspo take them as the advantages, reinforce_plus_plus_baseline only whitens
    them (rloo is refused by the config).

    grpo, gspo: (r − group mean) / (group std + eps), std unbiased as torch's; mean-centred only when
      `std_normalization` is False (Dr.GRPO). A group of one keeps its raw reward (nothing to compare).
      (GSPO differs from GRPO in the loss, by its per-sequence ratio: `gspo_log_ratio`.)
    reinforce_plus_plus: the raw reward; the rank turns it into token-level returns once it has the
      log-probs (`reinforce_pp_returns`, then `masked_whiten` over the whole batch).
    rloo: r_i − mean of the *other* samples of the group = n/(n−1) · (r_i − group mean).
    reinforce_plus_plus_baseline: r − group mean, then whitened over all samples of the step.
    """
    if estimator == "reinforce_plus_plus" or (post_processed and estimator in ("grpo", "gspo")):
        return [[float(r) for r in group] for group in rewards]
    out: list[list[float]] = []
    for group in rewards:
        r = torch.tensor(group, dtype=torch.float64)
        n = r.numel()
        if n <= 1 or post_processed:
            out.append(r.tolist())
            continue
        centred = r - r.mean()
        if estimator in ("grpo", "gspo"):
            adv = centred / (r.std() + eps) if std_normalization else centred
        elif estimator == "rloo":
            adv = centred * n / (n - 1)
        elif estimator == "reinforce_plus_plus_baseline":
            adv = centred
        else:
            raise ValueError(f"unknown advantage estimator {estimator!r}")
        out.append(adv.tolist())
    if estimator == "reinforce_plus_plus_baseline":
        flat = torch.tensor([a for g in out for a in g], dtype=torch.float64)
        if flat.numel() > 1:
            mean, std = flat.mean(), flat.std()
            out = [[(a - float(mean)) / (float(std) + eps) for a in g] for g in out]
    return out


def reinforce_pp_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """REINFORCE++ token-level returns (γ = 1), [B, T] aligned to targets like every token tensor.

    `rewards` holds each row's scalar reward on its response tokens (as `collate` lays out a
    `TrainRow.advantage`); the reward is placed on the row's last trained (mask 1) token. With
    kl_coef > 0 every trained token t also gets −kl_coef · kl_t (kl = log π_old − log π_ref). The return
    of token t is the sum of the token rewards from t to the end; untrained tokens return 0.
    """
    m = mask.to(torch.float32)
    t = m.shape[-1]
    pos = torch.arange(1, t + 1, dtype=torch.float32, device=m.device)
    last = (m * pos).argmax(-1, keepdim=True)  # the last trained token (0 for an empty row)
    has = (m.sum(-1, keepdim=True) > 0).to(torch.float32)
    token_r = torch.zeros_like(m).scatter(-1, last, rewards.to(torch.float32).gather(-1, last) * has)
    if kl_coef > 0:
        if kl is None:
            raise ValueError("kl_coef > 0 needs the per-token KL")
        token_r = token_r - kl_coef * kl.to(torch.float32) * m
    returns = token_r.flip(-1).cumsum(-1).flip(-1)
    return returns * m


def masked_whiten(
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    *,
    eps: float = 1e-8,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """(v − μ) / sqrt(σ² + eps) over the mask-1 entries of all `values` together (miles'
    `distributed_masked_whiten`: unbiased variance, mean shifted). `reduce` sums the float64 statistics
    [Σv, Σv², n] over other ranks (an all-reduce) so the whole data-parallel batch shares μ and σ.
    Masked-out entries come back as 0."""
    dev = values[0].device if values else torch.device("cpu")
    stats = torch.zeros(3, dtype=torch.float64, device=dev)
    for v, m in zip(values, masks, strict=True):
        v64, m64 = v.double(), m.double()
        stats += torch.stack([(v64 * m64).sum(), (v64 * v64 * m64).sum(), m64.sum()])
    if reduce is not None:
        stats = reduce(stats)
    total, total_sq, n = (float(x) for x in stats)
    if n < 1:
        return [torch.zeros_like(v) for v in values]
    mean = total / n
    var = max(total_sq / n - mean * mean, 0.0)
    if n > 1:
        var *= n / (n - 1)
    scale = 1.0 / math.sqrt(var + eps)
    return [((v - mean) * scale * (m > 0)).to(v.dtype) for v, m in zip(values, masks, strict=True)]


# -- per-token quantities --------------------------------------------------------------------------------
def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log π(target | prefix) per position: logits [B, T, V], targets [B, T] → [B, T] (float32)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position: [B, T, V] → [B, T] (float32)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimators of KL(π‖π_ref) from samples of π (Schulman's k1/k2/k3).

    k1 = log r, k2 = ½ (log r)², k3 = (r⁻¹ − 1) + log r with r = π/π_ref; low_var_kl = k3 clamped
    to [−10, 10] (as miles/verl), which keeps one wild token from dominating.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown KL type {kind!r}")


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip per token: max(−A·r, −A·clip(r, 1−eps_clip, 1+eps_clip_high)), r = exp(logp − old_logp).

    Returns (loss, clipped: 1.0 where the clipped branch was taken, ratio).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float(), ratio


def dual_clip(pg: torch.Tensor, advantages: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020): where A < 0 the PPO-clip loss is also bounded by −A·c (c > 1),
    pg' = min(pg, −A·c); elsewhere pg is unchanged. Returns (pg', active: 1.0 where the bound bit)."""
    bound = -advantages * c
    active = (advantages < 0) & (pg > bound)
    return torch.where(active, bound, pg), active.float()


def gspo_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's per-token log-ratio [B, T]: log s_i,t = sg[log s_i] + log π_t − sg[log π_t], with
    log s_i = mean over the row's trained tokens of (log π − log π_old). Every token's value is its
    sequence's ratio, while its gradient is s_i·∇log π_t (the sequence-level GSPO gradient)."""
    m = mask.to(logp.dtype)
    seq = ((logp.detach() - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
    return seq + logp - logp.detach()


def tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, *, low: float, high: float
) -> torch.Tensor:
    """Truncated importance weight clamp(π_old/π_rollout, low, high), detached (a constant in the loss)."""
    return torch.exp(old_logp - rollout_logp).clamp(low, high).detach()


# -- the loss --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LossSettings:
    """The loss-related flags of `TrainConfig` (kept separate so this module needs no config)."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    advantage_estimator: Estimator = "grpo"
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_decoupled_loss: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: KLType = "low_var_kl"
    entropy_coef: float = 0.0
    use_opsm: bool = False
    opsm_delta: float = 1e-4


@dataclass(slots=True)
class LossOutput:
    """`loss` to backpropagate, plus metrics as token-weighted sums (`sums`, with `sums["tokens"]`) and
    maxima (`maxes`), so micro-batches and ranks reduce them exactly before `finalize_metrics`."""

    loss: torch.Tensor
    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)


def policy_loss(
    *,
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    settings: LossSettings,
    num_tokens: float | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """The token-mean policy loss of one micro-batch (all [B, T] tensors aligned to targets).

    `logp` = log π of the targets (with grad; `token_log_probs`), `entropy` per token (with grad when
    entropy_coef > 0; only reported otherwise). Per token: pg = PPO-clip(π/π_old, A) × w, where w is
      1 (plain PPO), clamp(π_old/π_rollout, tis_clip_low, tis_clip) (`use_tis`), or π_old/π_rollout
      (`use_decoupled_loss`: AReaL's behaviour weight, clamped likewise when `use_tis` is also on);
    loss = Σ_mask (pg + kl_coef·KL(π‖π_ref) − entropy_coef·H) / num_tokens (default: this mask's sum).
    With `eps_clip_c` the PPO-clip term is dual-clipped (`dual_clip`). With the gspo estimator the
    ratio is the sequence's (`gspo_log_ratio`), so the clip acts per sequence; the TIS / decoupled
    behaviour weight stays per token (as in miles). kl_loss_coef 0 computes the KL for the metric only.
    OPSM zeroes the mask of sequences with A < 0 and mean(log π_rollout − log π) > opsm_delta.
    """
    s = settings
    mask = mask.to(torch.float32)
    if s.use_opsm:
        seq_tokens = mask.sum(-1).clamp_min(1.0)
        seq_kl = ((rollout_logp - logp.detach()) * mask).sum(-1) / seq_tokens
        seq_adv = (advantages * mask).sum(-1) / seq_tokens
        keep = ~((seq_adv < 0) & (seq_kl > s.opsm_delta))
        opsm_masked = float(((~keep).float() * (mask.sum(-1) > 0).float()).sum())
        mask = mask * keep.unsqueeze(-1).to(mask.dtype)
    denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
    denom = max(denom, 1.0)

    if s.advantage_estimator == "gspo":
        # ppo_clip_loss exponentiates logp − old_logp: pass the sequence log-ratio as "logp" against 0.
        pg_logp, pg_old = gspo_log_ratio(logp, old_logp, mask), torch.zeros_like(old_logp)
    else:
        pg_logp, pg_old = logp, old_logp
    pg, clipped, ratio = ppo_clip_loss(
        pg_logp, pg_old, advantages, eps_clip=s.eps_clip, eps_clip_high=s.eps_clip_high
    )
    dual: torch.Tensor | None = None
    if s.eps_clip_c is not None:
        pg, dual = dual_clip(pg, advantages, s.eps_clip_c)
    weight: torch.Tensor | None = None
    if s.use_decoupled_loss:
        weight = torch.exp(old_logp - rollout_logp).detach()
        if s.use_tis:
            weight = weight.clamp(s.tis_clip_low, s.tis_clip)
    elif s.use_tis:
        weight = tis_weights(old_logp, rollout_logp, low=s.tis_clip_low, high=s.tis_clip)
    if weight is not None:
        pg = pg * weight

    per_token = pg
    if s.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - s.entropy_coef * entropy
    kl: torch.Tensor | None = None
    if s.use_kl_loss:
        if ref_logp is None:
            raise ValueError("use_kl_loss needs ref_logp")
        if s.kl_loss_coef > 0:
            kl = kl_estimate(logp, ref_logp, s.kl_loss_type)
            per_token = per_token + s.kl_loss_coef * kl
        else:  # monitoring only (miles recipes pass --use-kl-loss --kl-loss-coef 0)
            kl = kl_estimate(logp.detach(), ref_logp, s.kl_loss_type)
    loss = (per_token * mask).sum() / denom

    with torch.no_grad():

        def msum(x: torch.Tensor) -> float:
            return float((x.detach().float() * mask).sum())

        diff = old_logp - rollout_logp  # log(π_old/π_rollout): the train/inference mismatch
        on = mask > 0
        sums = {
            "tokens": float(mask.sum()),
            "loss": float(loss.detach()) * denom,
            "pg_loss": msum(pg),
            "pg_clipfrac": msum(clipped),
            "ppo_kl": msum(old_logp - logp),
            "ratio": msum(ratio),
            "advantage": msum(advantages),
            "train_rollout_logp_abs_diff": msum(diff.abs()),
            # k3 estimate of KL(π_rollout‖π_old) from the rollout's own samples: ≥ 0, 0 iff they agree.
            "train_rollout_kl": msum(torch.exp(diff) - 1 - diff),
        }
        maxes = {"train_rollout_logp_abs_diff_max": float(diff.abs()[on].max()) if on.any() else 0.0}
        if weight is not None:
            sums["tis_weight"] = msum(weight)
            maxes["tis_weight_max"] = float(weight[on].max()) if on.any() else 0.0
            sums["tis_clipfrac"] = msum(
                ((torch.exp(diff) > s.tis_clip) | (torch.exp(diff) < s.tis_clip_low)).float()
            )
        if dual is not None:
            sums["dual_clipfrac"] = msum(dual)
        if entropy is not None:
            sums["entropy"] = msum(entropy)
        if kl is not None:
            sums["kl_loss"] = msum(kl)
        if s.use_opsm:
            sums["opsm_masked_seqs"] = opsm_masked
    return LossOutput(loss=loss, sums=sums, maxes=maxes)


def micro_batch_loss(
    logits: torch.Tensor,
    mb: MicroBatch,
    *,
    old_logp: torch.Tensor | None,
    settings: LossSettings,
    num_tokens: float,
    ref_logp: torch.Tensor | None = None,
) -> LossOutput:
    """`policy_loss` of one micro-batch from the policy's logits [B, T−1, V] (aligned to `mb.targets`).
    `old_logp` None: π_old is the policy these logits come from (one optimizer step per rollout), so the
    ratio is 1 and its value is this forward's own log-probs, detached.
    The entropy keeps its graph only when it is part of the loss (entropy_coef > 0)."""
    logp = token_log_probs(logits, mb.targets)
    if old_logp is None:
        old_logp = logp.detach()
    bonus = settings.entropy_coef > 0
    with torch.set_grad_enabled(bonus and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits if bonus else logits.detach())
    return policy_loss(
        logp=logp,
        mask=mb.mask,
        advantages=mb.advantages,
        old_logp=old_logp,
        rollout_logp=mb.rollout_logp,
        settings=settings,
        num_tokens=num_tokens,
        ref_logp=ref_logp,
        entropy=entropy,
    )


def finalize_metrics(sums: Mapping[str, float], maxes: Mapping[str, float]) -> dict[str, float]:
    """Token means from reduced sums (`loss` is per token of the whole batch), maxima as they are."""
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out: dict[str, float] = {}
    for key, value in sums.items():
        if key in ("tokens", "opsm_masked_seqs"):
            out[key] = value
        else:
            out[key] = value / tokens
    out.update(maxes)
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}


# -- micro-batches ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class TrainRow:
    """One sample as a rank trains it: prompt+response ids and per-response-token data."""

    tokens: torch.Tensor  # [L] int64
    response_length: int
    loss_mask: torch.Tensor  # [R]
    rollout_logp: torch.Tensor  # [R] float32
    advantage: float
    opt_step: int = 0  # which optimizer step of the rollout this sample belongs to


@dataclass(slots=True)
class MicroBatch:
    """Right-padded rows, with every per-token tensor [B, T−1] aligned to targets (see module doc)."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    targets: torch.Tensor  # [B, T-1] int64
    mask: torch.Tensor  # [B, T-1] float32
    rollout_logp: torch.Tensor  # [B, T-1] float32
    advantages: torch.Tensor  # [B, T-1] float32
    prompt_lengths: torch.Tensor  # [B] int64: tokens before the response

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.targets,
                    self.mask,
                    self.rollout_logp,
                    self.advantages,
                    self.prompt_lengths,
                )
            )
        )

    def masked_out(self) -> MicroBatch:
        """The same shapes with nothing trained: a filler step that keeps collectives in lockstep."""
        return MicroBatch(
            self.input_ids,
            self.attention_mask,
            self.targets,
            torch.zeros_like(self.mask),
            self.rollout_logp,
            self.advantages,
            self.prompt_lengths,
        )


def collate(rows: Sequence[TrainRow], *, pad_id: int = 0) -> MicroBatch:
    """Pad `rows` to one [B, T] batch. Response token j of a row with L tokens and R response tokens is
    token L−R+j, predicted at target index L−R−1+j. A few vectorized ops, not some per row: a rollout's
    hundreds of short rows made the per-row loop a tenth of a small model's step."""
    if not rows:
        raise ValueError("empty micro-batch")
    lengths = torch.tensor([int(r.tokens.numel()) for r in rows])
    resp = torch.tensor([r.response_length for r in rows])
    if bool(((resp > 0) & (lengths - resp < 1)).any()):
        raise ValueError("a sample needs at least one prompt token before its response")
    b, t = len(rows), int(lengths.max())
    input_ids = torch.nn.utils.rnn.pad_sequence(
        [r.tokens.long() for r in rows], batch_first=True, padding_value=pad_id
    )
    attention = (torch.arange(t)[None, :] < lengths[:, None]).long()
    # every response token's (row, target index), in the rows' order
    row = torch.repeat_interleave(torch.arange(b), resp)
    first = torch.cumsum(resp, 0) - resp  # where each row's tokens start in the concatenation
    col = (lengths - resp - 1)[row] + torch.arange(int(resp.sum())) - first[row]
    mask = torch.zeros((b, t - 1))
    rollout = torch.zeros((b, t - 1))
    adv = torch.zeros((b, t - 1))
    if len(row):
        mask[row, col] = torch.cat([r.loss_mask for r in rows if r.response_length]).float()
        rollout[row, col] = torch.cat([r.rollout_logp for r in rows if r.response_length]).float()
        adv[row, col] = torch.tensor([r.advantage for r in rows], dtype=torch.float32)[row]
    prompt_lengths = lengths - resp
    return MicroBatch(input_ids, attention, input_ids[:, 1:].clone(), mask, rollout, adv, prompt_lengths)


def split_micro_batches(
    rows: Sequence[TrainRow], *, micro_batch_size: int, max_tokens: int | None = None
) -> list[list[TrainRow]]:
    """Rows in order, `micro_batch_size` at a time, or greedily packed up to `max_tokens` padded tokens
    per micro-batch (a row longer than the budget gets a micro-batch of its own)."""
    if max_tokens is None:
        return [list(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    out: list[list[TrainRow]] = []
    cur: list[TrainRow] = []
    longest = 0
    for row in rows:
        n = int(row.tokens.numel())
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(row)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


@dataclass(slots=True)
class StepShards:
    """A rollout's samples, ready for the ranks: rows per data-parallel rank, and for each optimizer
    step the masked-token count of its whole global batch (the loss denominator)."""

    shards: list[list[TrainRow]]
    num_tokens: list[float]
    advantages: list[float]
    masked_offpolicy: int = 0
    """Trainable tokens masked by --mask-offpolicy-in-partial-rollout."""


def shard_batch(
    batch: Sequence[Sequence[Sample]],
    *,
    estimator: Estimator,
    std_normalization: bool,
    reward_key: str | None,
    global_batch_size: int,
    dp_size: int,
    mask_offpolicy: bool = False,
    processed_rewards: Sequence[float] | None = None,
) -> StepShards:
    """Advantages over all of the step's groups (so every rank sees the same ones), then samples in
    order: optimizer step j takes samples [j·gbs, (j+1)·gbs), and dp rank d its d-th equal slice.
    `mask_offpolicy` (--mask-offpolicy-in-partial-rollout): `newest_version_mask` on every sample.
    `processed_rewards` (one per sample, in order): a reward post-process's output, used instead."""
    samples = [s for g in batch for s in g]
    if processed_rewards is None:
        rewards = [[scalar_reward(s.reward, reward_key) for s in g] for g in batch]
    else:
        flat = iter(processed_rewards)
        rewards = [[next(flat) for _ in g] for g in batch]
    grouped = compute_advantages(
        rewards, estimator, std_normalization=std_normalization, post_processed=processed_rewards is not None
    )
    advantages = [a for g in grouped for a in g]
    per_dp = global_batch_size // dp_size
    masked_offpolicy = 0
    shards: list[list[TrainRow]] = [[] for _ in range(dp_size)]
    num_tokens = [0.0] * (len(samples) // global_batch_size)
    for i, (s, adv) in enumerate(zip(samples, advantages, strict=True)):
        s.validate()
        j = i // global_batch_size
        mask = newest_version_mask(s) if mask_offpolicy else s.loss_mask
        kept = sum(mask)
        masked_offpolicy += sum(s.loss_mask) - kept if mask_offpolicy else 0
        row = TrainRow(
            tokens=tensor_of(s.tokens, torch.int64),
            response_length=s.response_length,
            loss_mask=tensor_of(mask, torch.float32),
            rollout_logp=tensor_of(s.rollout_log_probs, torch.float32),
            advantage=adv,
            opt_step=j,
        )
        shards[(i % global_batch_size) // per_dp].append(row)
        num_tokens[j] += float(kept)
    return StepShards(shards, num_tokens, advantages, masked_offpolicy)


_TYPECODES: Final = {torch.int64: "q", torch.float32: "f"}


def tensor_of(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of `values` (int64 or float32), built through `array.array`: one C loop over the list,
    3-4× faster than `torch.tensor(list)`, which inspects every element's type (a batch of 256 samples of
    1,500 tokens took the controller's loop 0.15 s per step that way, `benchmarks.trainer_data`)."""
    if len(values):
        try:
            return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)  # keeps the array
        except (TypeError, OverflowError):
            pass  # not plain numbers: torch's own conversion, and its own error
    return torch.tensor(values, dtype=dtype)


def newest_version_mask(s: Sample) -> list[int]:
    """`s.loss_mask` with 0 on every token an older policy produced than the response's newest token
    (tokens of unknown version, before the first push, count as older once a known version exists)."""
    known = [v for v in s.weight_versions if v is not None]
    if not known:
        return list(s.loss_mask)
    newest = max(known)
    return [m if v == newest else 0 for m, v in zip(s.loss_mask, s.weight_versions, strict=True)]

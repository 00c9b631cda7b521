"""Turning logits into one next token per row, and the logprobs the engine reports.

Per row, in SGLang's order (`sglang/srt/sampling/sampling_batch_info.py` `apply_logits_bias`, then
`sglang/srt/layers/sampler.py`):

1. logit processing: frequency / presence penalties (additive, over the row's output tokens so far),
   `min_new_tokens` (stop tokens and EOS forbidden until that many tokens exist), repetition penalty
   (scaling, over output tokens), then `logit_bias`;
2. logprobs: `log_softmax(logits / T)` for temperature T > 0, `log_softmax(logits)` when greedy, taken
   *before* top-k/top-p/min-p truncation (SGLang's default, without `SGLANG_RETURN_ORIGINAL_LOGPROB`).
   The sampled token's logprob, the top-n and the asked-for token ids all come from this distribution;
3. sampling from the tempered, truncated, renormalised distribution, with one uniform per row drawn
   from the request's own `random.Random`, so a request's tokens never depend on what shares its batch.

RL consequence: at temperature 1 with no penalties, the reported logprob is exactly what a trainer
computes, `log_softmax(model(tokens))`, because truncation is not reflected. Input (prompt) logprobs
are `log_softmax(logits)` with no temperature and no processing, as SGLang's logits processor.

The common RL case (no processing, no top-n, no truncation) is one vectorised pass over the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

__all__ = ["GREEDY_EPS", "TOP_K_ALL", "RowSampling", "SampledRow", "SamplingParams", "sample_batch", "top_n"]

GREEDY_EPS: Final = 1e-6
"""Temperatures below this are greedy, as in SGLang (`_SAMPLING_EPS`)."""
TOP_K_ALL: Final = 1 << 30
"""SGLang's 'no top-k' default (`SamplingParams.top_k` = 1073741824); -1 means the same."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """SGLang's `SamplingParams`, the fields this engine implements (validated in `protocol.py`)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits (SGLang's `logit_bias` dict, keys parsed)."""
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def truncates(self) -> bool:
        return self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def processes_logits(self) -> bool:
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_new_tokens
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RowSampling:
    """What sampling one row needs besides its logits. Built on the event loop, read on the compute thread.

    `output_ids` is the request's live list: the loop appends to it only between steps, never while the
    compute thread reads it.
    """

    params: SamplingParams
    rng: random.Random
    output_ids: Sequence[int] = ()
    stop_ids: frozenset[int] = frozenset()
    """EOS and stop token ids, forbidden while fewer than `min_new_tokens` outputs exist."""
    top_n: int = 0
    token_ids: tuple[int, ...] = ()

    @property
    def plain(self) -> bool:
        """Temperature 1 from the full distribution, nothing else asked: the RL rollout case."""
        p = self.params
        return (
            p.temperature == 1.0
            and not self.top_n
            and not self.token_ids
            and not p.truncates
            and not p.processes_logits
        )


@dataclass(frozen=True, slots=True)
class SampledRow:
    token: int
    logprob: float
    top: list[tuple[float, int]] | None = None
    """The `top_n` most likely tokens (logprob, id), most likely first; None when none were asked."""
    token_ids: list[tuple[float, int]] | None = None
    """The asked-for ids' logprobs, in the order asked; None when none were asked."""


def sample_batch(logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[SampledRow]:
    """One token and its logprobs (see the module rule) per row of float32 `logits` [B, vocab]."""
    if all(r.plain for r in rows):
        return _sample_plain(logits, rows)
    if any(r.params.processes_logits for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.processes_logits:
                _process(logits[i], r)
    temps = [1.0 if r.params.greedy else r.params.temperature for r in rows]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps)[:, None]
    # Clamped as SGLang does: a forbidden token's logprob is the float minimum, not -inf (JSON has no -inf).
    logprobs = torch.log_softmax(scaled, dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    tokens = torch.argmax(logits, dim=-1)  # greedy rows keep this; ties pick the lowest id, like torch
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        probs = torch.softmax(scaled[sampled], dim=-1)
        truncating = [rows[i].params for i in sampled]
        if any(p.truncates for p in truncating):
            probs = _truncated_probs(probs, truncating)
        # Inverse-CDF sampling with ONE uniform per row from the request's own generator: vectorised, and
        # a request's draws do not depend on its batch. side="right" never lands on a zero-mass token.
        u = torch.tensor([rows[i].rng.random() for i in sampled], dtype=probs.dtype)
        cdf = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[sampled] = picked.clamp_(max=probs.shape[-1] - 1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    ids = tokens.tolist()
    out: list[SampledRow] = []
    for i, r in enumerate(rows):
        top = top_n(logprobs[i], r.top_n) if r.top_n > 0 else None
        asked = _token_ids(logprobs[i], r.token_ids) if r.token_ids else None
        out.append(SampledRow(ids[i], chosen[i], top, asked))
    return out


def _sample_plain(logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[SampledRow]:
    """`sample_batch` for rows that are all `plain`: the same rule, no per-row work but the draw."""
    logprobs = torch.log_softmax(logits, dim=-1)
    u = torch.tensor([r.rng.random() for r in rows], dtype=logits.dtype)
    cdf = logprobs.exp().cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
    chosen = logprobs.gather(1, tokens).clamp_(min=torch.finfo(torch.float32).min)
    return [SampledRow(t, lp) for t, lp in zip(tokens[:, 0].tolist(), chosen[:, 0].tolist(), strict=True)]


def top_n(logprobs: torch.Tensor, n: int) -> list[tuple[float, int]]:
    """The n largest entries of a [vocab] logprob row as (logprob, id), largest first."""
    values, idx = torch.topk(logprobs, min(n, logprobs.shape[-1]))
    return list(zip(values.tolist(), idx.tolist(), strict=True))


def _token_ids(logprobs: torch.Tensor, ids: tuple[int, ...]) -> list[tuple[float, int]]:
    return list(zip(logprobs[list(ids)].tolist(), ids, strict=True))


def _process(row: torch.Tensor, r: RowSampling) -> None:
    """SGLang's logit processing for one row, in place (see the module docstring for the order)."""
    p = r.params
    out = r.output_ids
    if out and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
        counts = torch.bincount(torch.tensor(out), minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        if p.frequency_penalty:
            row -= p.frequency_penalty * counts
        if p.presence_penalty:
            row -= p.presence_penalty * (counts > 0).to(row.dtype)
    if p.min_new_tokens and len(out) < p.min_new_tokens and r.stop_ids:
        row[list(r.stop_ids)] = float("-inf")
    if out and p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(out)))
        vals = row[seen]
        row[seen] = torch.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
    if p.logit_bias:
        ids = [t for t, _ in p.logit_bias]
        row[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype)


def _truncated_probs(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p per row, then renormalise (rows: [n, vocab], already tempered)."""
    vocab = probs.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)[None, :]
    keep = rank < top_k[:, None]
    # top-p: keep the smallest prefix whose mass reaches top_p (a token is kept if the mass before it < p).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < top_p[:, None]
    keep &= sorted_probs >= (min_p * sorted_probs[:, 0])[:, None]
    keep[:, 0] = True  # the most likely token always survives
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    out = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return out / out.sum(dim=-1, keepdim=True)

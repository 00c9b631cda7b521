"""Sampling one next token per row, and the logprob the engine reports for it.

Logprob rule (SGLang's default, `sglang/srt/layers/sampler.py`, without `SGLANG_RETURN_ORIGINAL_LOGPROB`):

* temperature T > 0: `log_softmax(logits / T)[token]`, the tempered distribution *before* top-k/top-p/
  min-p truncation and renormalisation;
* greedy (T == 0): `log_softmax(logits)[token]`.

RL consequence: with the recipe's rollout temperature 1, the reported logprob is exactly what a trainer
computes, `log_softmax(model(tokens))` at temperature 1 on the same weights, because truncation is not
reflected. If a recipe samples with T ≠ 1, the trainer must divide its logits by the same T to compare.

Sampling draws from the tempered, truncated, renormalised distribution with the request's own
`torch.Generator`, so a request's tokens do not depend on what else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

__all__ = ["GREEDY_EPS", "SamplingParams", "sample_batch"]

GREEDY_EPS: Final = 1e-6
"""Temperatures below this are greedy, as in SGLang (`_SAMPLING_EPS`)."""
TOP_K_ALL: Final = 1 << 30
"""SGLang's 'no top-k' default (`SamplingParams.top_k` = 1073741824); -1 means the same."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """The subset of SGLang's `SamplingParams` this engine implements (validated in `protocol.py`)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> tuple[list[int], list[float]]:
    """One token and its logprob (see the module rule) per row of float32 `logits` [B, vocab]."""
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(logits, dim=-1)  # greedy rows keep this; ties pick the lowest id, like torch
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = logprobs[rows].exp()
        row_params = [params[i] for i in rows]
        if any(p.top_k < probs.shape[-1] or p.top_p < 1.0 or p.min_p > 0.0 for p in row_params):
            probs = _truncated_probs(probs, row_params)
        # Inverse-CDF sampling with ONE uniform per row from the request's own generator: vectorised, and
        # a request's draws do not depend on its batch. side="right" never lands on a zero-mass token.
        u = torch.cat([torch.rand(1, generator=generators[i], dtype=probs.dtype) for i in rows])
        cdf = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[rows] = picked.clamp_(max=probs.shape[-1] - 1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


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

"""The compute side of the engine: executes one planned step, and keeps the prefix cache's KV.

`ModelRunner.step(plan)` consumes a `StepPlan` built on the event loop (which rows to prefill, which to
decode, with what sampling) and produces a `StepResult` (one token + logprob per row, and prompt KV to
cache). It runs on the engine's single compute thread and never touches request bookkeeping, so the
event loop stays the only owner of scheduling state; the loop in turn never touches tensors.

Prefix cache: prompt KV keyed by the prompt's tokens and tagged with the *weights epoch* it was computed
under. The engine bumps the epoch on every weight load, and a lookup only matches entries of the
current epoch, so KV computed under old weights is never served to a later request, even when an update
asked for `flush_cache: false` or a frozen in-place request is still running on its old KV.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

import torch

from miles_aio.engine.model import KVPool, LlamaModel
from miles_aio.engine.sampling import RowSampling, SampledRow, sample_batch, top_n

__all__ = ["CachedPrefix", "ModelRunner", "PrefixCache", "Row", "ScoredInput", "StepPlan", "StepResult"]


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """Keys/values of a prompt, per layer [n_kv_heads, length, head_dim], and the weights epoch."""

    tokens: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    epoch: int
    namespace: tuple[str | None, str | None] = (None, None)
    """SGLang's (`extra_key`, `cache_salt`): a prefix is reused only by requests of the same namespace."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One sequence in a step: feed `tokens` at positions start.. into `slot`, then sample one token."""

    slot: int
    tokens: list[int]
    start: int
    sampling: RowSampling | None
    """How to sample the next token; None for a prefill that only scores its input (max_new_tokens 0)."""
    reuse: CachedPrefix | None = None
    """Copy this prefix's first `start` positions into the slot before feeding (a prefix-cache hit)."""
    save_prefix: int = 0
    """After the forward, return a copy of the slot's first `save_prefix` positions for the cache."""
    score_from: int | None = None
    """Prefill only: return the logprobs of the fed tokens from this index of `tokens` on (index >= 1:
    token j is scored by the logits at fed position j - 1)."""
    score_top_n: int = 0
    score_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoredInput:
    """Logprobs of fed (prompt) tokens, one entry per scored token."""

    logprobs: list[float]
    top: list[list[tuple[float, int]]] | None
    token_ids: list[list[tuple[float, int]]] | None


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    prefills: list[Row]
    """Rows fed one at a time (many tokens each)."""
    decodes: list[Row]
    """Rows fed together as one batch (one token each)."""

    @property
    def rows(self) -> list[Row]:
        return [*self.prefills, *self.decodes]

    def single(self, i: int) -> StepPlan:
        """The plan of row `i` alone (plan order: prefills, then decodes)."""
        n = len(self.prefills)
        return (
            StepPlan(prefills=[self.prefills[i]], decodes=[])
            if i < n
            else StepPlan(prefills=[], decodes=[self.decodes[i - n]])
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    sampled: list[SampledRow | None]
    """One sampled token per row (None for score-only rows): prefills first, then decodes, in plan order."""
    scored: dict[int, ScoredInput] = field(default_factory=dict)
    """Prefill row index → its input logprobs, for rows with `score_from`."""
    saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    """Prefill row index → prompt keys/values, for rows with `save_prefix`."""
    seconds: float = 0.0


class ModelRunner:
    """Owns the model and the KV pool. Call every method from the compute thread.

    Everything that touches the KV pool runs under `torch.inference_mode`, the pool's allocation and
    every regrowth included: a tensor created in inference mode may not be written outside it (that mix
    is what broke the engine once a sequence outgrew the pool's first 256 positions). Steps are idempotent
    on the KV (a step writes each fed token's keys/values at its own position), so a failed step can be
    re-run row by row to find the rows that fail.
    """

    def __init__(
        self, model: LlamaModel, *, max_running: int, context_len: int, fault_token: int | None = None
    ) -> None:
        self.model = model
        self.fault_token = fault_token
        """Fault injection for tests (`MILES_AIO_ENGINE_FAULT_TOKEN`): a step feeding this token raises."""
        with torch.inference_mode():
            self.kv = KVPool(model.spec, num_slots=max_running, context_len=context_len, dtype=model.dtype)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepResult:
        """Feed every row, then sample. Rows are grouped into as few forwards as their shapes allow:

        * one-token rows (decodes, and prefills whose prompt the cache covers) form one batch;
        * a prefill that scores its input runs alone (it needs the logits of every position);
        * other prefills run in padded batches of similar lengths (`_prefill_batches`): a shorter row's
          padding writes keys/values only at positions past its own end, which no query of it attends to
          and which its later tokens overwrite before they are read.
        """
        t0 = time.perf_counter()
        rows = plan.rows
        if self.fault_token is not None and any(self.fault_token in r.tokens for r in rows):
            raise RuntimeError(f"injected fault: token {self.fault_token} fed (MILES_AIO_ENGINE_FAULT_TOKEN)")
        n_pre = len(plan.prefills)
        for row in plan.prefills:
            if row.reuse is not None and row.start:
                self.kv.write(row.slot, row.reuse.k, row.reuse.v, row.start)
        row_logits: list[torch.Tensor | None] = [None] * len(rows)
        scored: dict[int, ScoredInput] = {}
        singles = [i for i, r in enumerate(rows) if len(r.tokens) == 1 and r.score_from is None]
        scoring = [i for i in range(n_pre) if rows[i].score_from is not None]
        padded = [i for i in range(n_pre) if i not in set(singles) and rows[i].score_from is None]
        for i in scoring:
            row = rows[i]
            assert row.score_from is not None
            out = self._forward([row], logits_from=row.score_from - 1)
            scored[i] = _score(out[:-1], row.tokens[row.score_from :], row)
            row_logits[i] = out[-1]
        for batch in _prefill_batches([len(rows[i].tokens) for i in padded], padded):
            for i, lg in zip(batch, self._forward([rows[i] for i in batch]), strict=True):
                row_logits[i] = lg
        if singles:
            by_slot = sorted(singles, key=lambda i: rows[i].slot)  # consecutive slots attend via a view
            for i, lg in zip(by_slot, self._forward([rows[i] for i in by_slot]), strict=True):
                row_logits[i] = lg
        saved = {i: self.kv.read(r.slot, r.save_prefix) for i, r in enumerate(plan.prefills) if r.save_prefix}
        live = [i for i, r in enumerate(rows) if r.sampling is not None]
        sampled: list[SampledRow | None] = [None] * len(rows)
        if live:
            picked = torch.stack([lg for i in live if (lg := row_logits[i]) is not None])
            draws = sample_batch(picked, [s for i in live if (s := rows[i].sampling) is not None])
            for i, d in zip(live, draws, strict=True):
                sampled[i] = d
        return StepResult(sampled=sampled, scored=scored, saved=saved, seconds=time.perf_counter() - t0)

    def _forward(self, rows: list[Row], *, logits_from: int | None = None) -> torch.Tensor:
        """One forward over `rows` (right-padded to the longest); the logits of each row's last token
        [B, vocab], or with `logits_from` (one row) of every position from there on."""
        t = max(len(r.tokens) for r in rows)
        if len(rows) > 1 and max(r.start for r in rows) + t > self.kv.context_len:
            # Padding would run past the context window: feed these rows one by one instead.
            return torch.cat([self._forward([r]) for r in rows])
        tokens = torch.tensor([r.tokens + [0] * (t - len(r.tokens)) for r in rows])
        positions = torch.tensor([list(range(r.start, r.start + t)) for r in rows])
        kv_len = max(r.start for r in rows) + t  # padding writes up to here too: the pool must hold it
        ragged = any(len(r.tokens) != t for r in rows)
        last = torch.tensor([len(r.tokens) - 1 for r in rows]) if ragged else None
        return self.model.forward(
            tokens,
            positions,
            slots=torch.tensor([r.slot for r in rows]),
            kv=self.kv,
            kv_len=kv_len,
            logits_from=logits_from,
            last_index=last,
        )

    @torch.inference_mode()
    def apply_weights(self, staged: dict[str, torch.Tensor]) -> None:
        """Copy validated tensors into the live weights (the caller bumps the weights epoch)."""
        for name, tensor in staged.items():
            self.model.weights[name].copy_(tensor)
        self.model.weights_changed()


_PAD_WASTE: Final = 1.25
"""A padded prefill batch computes at most this many times its real tokens."""
_BATCH_TOKENS: Final = 8192
"""At most this many (padded) tokens per prefill forward: bounds the attention's memory."""


def _prefill_batches(lengths: list[int], ids: list[int]) -> list[list[int]]:
    """Group prefill rows (`ids`, of `lengths`) into padded batches: longest first, a row joins the
    current batch while padding stays within `_PAD_WASTE` of the real tokens and `_BATCH_TOKENS`."""
    order = sorted(range(len(ids)), key=lambda k: -lengths[k])
    batches: list[list[int]] = []
    longest = real = 0
    for k in order:
        n = lengths[k]
        if batches and (len(batches[-1]) + 1) * longest <= min(_PAD_WASTE * (real + n), _BATCH_TOKENS):
            batches[-1].append(ids[k])
            real += n
        else:
            batches.append([ids[k]])
            longest = real = n
    return batches


def _score(logits: torch.Tensor, tokens: list[int], row: Row) -> ScoredInput:
    """Input logprobs: `log_softmax` of the raw logits (no temperature), as SGLang's logits processor."""
    logprobs = torch.log_softmax(logits, dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    ids = torch.tensor(tokens)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    top = [top_n(lp, row.score_top_n) for lp in logprobs] if row.score_top_n > 0 else None
    asked = None
    if row.score_token_ids:
        vals = logprobs[:, list(row.score_token_ids)].tolist()
        asked = [list(zip(v, row.score_token_ids, strict=True)) for v in vals]
    return ScoredInput(logprobs=chosen, top=top, token_ids=asked)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], n: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `n` (both at least `n` long)."""
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """LRU map prompt → KV, by longest common prefix, matching only the current weights epoch.

    Owned by the event loop (lookups and inserts happen while planning/applying a step); the tensors it
    holds are never written after insertion, so handing them to the compute thread is safe.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, tokens: list[int], *, epoch: int, namespace: tuple[str | None, str | None] = (None, None)
    ) -> tuple[int, CachedPrefix | None]:
        """The longest reusable prefix of `tokens` (at most len - 1: the last token must be fed).

        Runs on the engine's event loop for every request start, over every entry: it compares the
        entries' token tuples (C-level slice comparisons, a binary search for the mismatch) rather than
        tensors, which cost several torch calls per entry (~1 ms per request with 64 entries)."""
        if not self._entries or len(tokens) < 2:
            return 0, None
        query = tuple(tokens)
        best, best_key = 0, None
        for key, entry in self._entries.items():
            if entry.epoch != epoch or entry.namespace != namespace or not key or key[0] != query[0]:
                continue
            lcp = _common_prefix(key, query, min(len(key), len(query) - 1))
            if lcp > best:
                best, best_key = lcp, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, self._entries[best_key]

    def insert(
        self,
        tokens: list[int],
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        *,
        epoch: int,
        namespace: tuple[str | None, str | None] = (None, None),
    ) -> None:
        if self.max_entries <= 0:
            return
        key = tuple(tokens)
        if (old := self._entries.get(key)) is not None and old.namespace != namespace:
            del self._entries[key]  # one entry per prompt: the newest namespace wins
        self._entries[key] = CachedPrefix(
            tokens=torch.tensor(tokens), k=k, v=v, epoch=epoch, namespace=namespace
        )
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

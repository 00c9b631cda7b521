"""--pack-shared-prompts: one forward per prompt, not per sample (a GRPO group shares its prompt).

A micro-batch of right-padded rows (`losses.MicroBatch`) encodes each prompt once per sample: with 8
samples per prompt, a short answer after a long prompt costs 8 prompt forwards and backwards. `plan` packs
the rows that share a prompt into one sequence instead, the prompt once and then each row's response
after it:

    row a:  p0 p1 p2 | a0 a1            packed: p0 p1 p2 a0 a1 b0 b1 b2
    row b:  p0 p1 p2 | b0 b1 b2         positions: 0 1 2 3 4 3 4 5

A 4D attention mask lets every response token see the whole prompt and its own response's earlier
tokens, never another response, and the position ids restart after the prompt for every response. So
every token sees exactly the context, at exactly the RoPE positions, it has in its own row: the same
math, up to the order of float sums. `unpack` gathers the packed logits back into the rows' [B, T−1, V]
layout, so the loss path is unchanged; the backward sums each shared prompt token's gradient over the
responses that read it, as the separate rows would.

Pure tensor code, no process group: tested against the unpacked forward in tests/trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["Packing", "plan", "unpack"]


@dataclass(frozen=True, slots=True)
class Packing:
    """The packed forward's inputs, and where each row's logits are in its output."""

    input_ids: torch.Tensor  # [G, L] int64: a prompt, then its rows' responses; 0-padded
    position_ids: torch.Tensor  # [G, L] int64: each response restarts at its prompt's length
    allowed: torch.Tensor  # [G, 1, L, L] bool: query q may attend key k
    group: torch.Tensor  # [B] int64: the packed sequence holding row i
    index: torch.Tensor  # [B, T−1] int64: the packed position whose logits predict row i's target t

    def attention_mask(self, dtype: torch.dtype | None) -> torch.Tensor:
        """`allowed` as the model's attention wants it: bool (sdpa), or additive in `dtype` (eager)."""
        if dtype is None:
            return self.allowed
        zero = torch.zeros((), dtype=dtype, device=self.allowed.device)
        return torch.where(self.allowed, zero, torch.finfo(dtype).min)


def plan(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor
) -> Packing | None:
    """Pack right-padded rows ([B, T] ids and 0/1 mask; [B] prompt lengths) by identical prompt; None when
    no two rows share one (packing would save nothing)."""
    lengths = attention_mask.sum(1).tolist()
    prompts = prompt_lengths.tolist()
    ids = input_ids.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(ids[i][:p]), []).append(i)
    if len(groups) == len(ids):
        return None
    t = input_ids.shape[1]
    group_of = [0] * len(ids)
    index = [[0] * (t - 1) for _ in ids]  # padding targets point at position 0: masked out of the loss
    seqs: list[list[int]] = []
    positions: list[list[int]] = []
    segments: list[list[int]] = []  # 0: the prompt, j ≥ 1: the j-th response
    for g, (prompt, rows) in enumerate(groups.items()):
        p = len(prompt)
        seq, pos, seg = list(prompt), list(range(p)), [0] * p
        for j, i in enumerate(rows, start=1):
            group_of[i], start, n = g, len(seq), lengths[i]
            seq += ids[i][p:n]
            pos += range(p, n)
            seg += [j] * (n - p)
            shared = min(p, n - 1)
            index[i][:shared] = range(shared)  # logits at a prompt position: the shared ones
            index[i][p : n - 1] = range(start, start + n - 1 - p)  # at response token k − p of this row
        seqs.append(seq)
        positions.append(pos)
        segments.append(seg)

    def padded(rows: list[list[int]], value: int) -> torch.Tensor:
        return pad_sequence(
            [torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True, padding_value=value
        )

    device = input_ids.device  # the [G, L, L] mask is built there, not copied there
    packed, pos_ids = padded(seqs, 0), padded(positions, 0)
    seg_ids = padded(segments, -1).to(device)  # padding: a segment of its own, which attends to itself only
    width = packed.shape[1]
    query, key = seg_ids[:, :, None], seg_ids[:, None, :]
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    pad_self = torch.eye(width, dtype=torch.bool, device=device)
    same = (query == key) & ((query != -1) | pad_self)  # a pad sees only itself
    allowed = causal & (same | ((key == 0) & (query >= 0)))
    return Packing(
        input_ids=packed.to(device),
        position_ids=pos_ids.to(device),
        allowed=allowed[:, None],
        group=torch.tensor(group_of, dtype=torch.long, device=device),
        index=torch.tensor(index, dtype=torch.long, device=device),
    )


def unpack(logits: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The packed forward's logits [G, L, V] in the rows' layout [B, T−1, V] (aligned to their targets)."""
    return logits[packing.group[:, None], packing.index]

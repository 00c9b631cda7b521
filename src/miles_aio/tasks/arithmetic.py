"""Two-digit addition: `ab+cd=` → the digits of the sum. Data, reward, tiny model and SFT warm start.

Why this task: it is verifiable (exact match), its vocabulary is 12 characters, and a ~0.4M-parameter
model learns it on 2 CPU cores in minutes. RL from random init does not (a random policy almost never
sees a reward), so the quickstart first fine-tunes the model on a little supervised data until it is
right about 20-35% of the time, then lets GRPO take it from there (see reference/cpu-learning-probe.md).

There are 90 × 90 = 8,100 problems; a fixed, seeded set of held-out problems is never trained on.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from miles_aio.types import Sample

__all__ = ["ALPHABET", "Problem", "answer_reward", "make_splits", "warm_start", "write_jsonl"]

ALPHABET = "0123456789+="
log = structlog.get_logger("miles_aio.tasks.arithmetic")


@dataclass(frozen=True, slots=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def make_splits(*, n_eval: int = 200, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems; the held-out set never appears in training or warm-up."""
    problems = [Problem(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(problems)
    return problems[n_eval:], problems[:n_eval]


def write_jsonl(problems: Sequence[Problem], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "label": p.answer}) + "\n")
    return path


def parse_answer(response: str) -> str:
    """The response up to the first non-digit (the model ends with EOS, which decodes to nothing)."""
    digits = []
    for ch in response:
        if not ch.isdigit():
            break
        digits.append(ch)
    return "".join(digits)


async def answer_reward(ctx: Any, sample: Sample) -> float:
    """1.0 for the exact sum, else 0.0 (a binary, verifiable reward)."""
    return float(parse_answer(sample.response) == str(sample.label))


def warm_start(
    out_dir: Path,
    train: Sequence[Problem],
    *,
    target_accuracy: float = 0.2,
    max_steps: int = 2000,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    probe_size: int = 200,
    check_every: int = 50,
) -> dict[str, float]:
    """Build the tiny model and fine-tune it until greedy accuracy on a train probe reaches the target.

    Writes an HF checkpoint to `out_dir` (loadable by transformers, the embedded engine and SGLang) and
    returns what happened: steps, seconds, probe accuracy.
    """
    import torch

    from miles_aio.models.tiny import build_tiny_llama, load_tokenizer

    torch.manual_seed(seed)
    build_tiny_llama(
        out_dir,
        alphabet=ALPHABET,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        max_position_embeddings=32,
        seed=seed,
    )
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    eos = int(tok.eos_token_id)
    rng = random.Random(seed)
    probe = rng.sample(list(train), min(probe_size, len(train)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0, acc, step = time.monotonic(), 0.0, 0
    model.train()
    for step in range(1, max_steps + 1):
        batch = rng.sample(list(train), batch_size)
        ids, labels = _sft_batch(tok, batch, eos)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check_every == 0:
            acc = greedy_accuracy(model, tok, probe, eos)
            log.info("warm start", step=step, loss=round(float(loss), 4), probe_accuracy=acc)
            if acc >= target_accuracy:
                break
    model.save_pretrained(out_dir, safe_serialization=True)
    return {"steps": float(step), "seconds": time.monotonic() - t0, "probe_accuracy": acc}


def _sft_batch(tok: Any, batch: Sequence[Problem], eos: int) -> tuple[Any, Any]:
    import torch

    rows = [(tok.encode(p.prompt), [*tok.encode(p.answer), eos]) for p in batch]
    width = max(len(q) + len(a) for q, a in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (q, a) in enumerate(rows):
        seq = q + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(q) : len(seq)] = torch.tensor(a)  # learn the answer only
    return ids, labels


def greedy_accuracy(model: Any, tok: Any, problems: Sequence[Problem], eos: int, max_new: int = 4) -> float:
    """Exact-match accuracy of greedy decoding (full recompute; all prompts have the same length)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([tok.encode(p.prompt) for p in problems])
        out = ids
        for _ in range(max_new):
            nxt = model(input_ids=out).logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
    correct = 0
    for p, row in zip(problems, out[:, ids.shape[1] :].tolist(), strict=True):
        answer = row[: row.index(eos)] if eos in row else row
        correct += tok.decode(answer) == p.answer
    return correct / len(problems)

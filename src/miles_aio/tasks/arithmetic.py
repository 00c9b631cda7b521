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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from miles_aio.types import Sample

__all__ = [
    "ALPHABET",
    "Problem",
    "Segment",
    "answer_reward",
    "greedy_solve",
    "make_splits",
    "sft_batch",
    "warm_start",
    "write_jsonl",
]

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


Segment = tuple[str, bool]
"""A piece of a supervised example: its text, and whether the loss is taken on it."""


def direct_render(p: Problem) -> list[Segment]:
    return [(p.prompt, False), (p.answer, True)]


def warm_start(
    out_dir: Path,
    train: Sequence[Problem],
    *,
    alphabet: str = ALPHABET,
    render: Callable[[Problem], list[Segment]] = direct_render,
    solve: Callable[[Any, Any, Sequence[Problem]], list[str]] | None = None,
    target_accuracy: float = 0.2,
    max_steps: int = 2000,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    probe_size: int = 200,
    check_every: int = 50,
    model_kwargs: Mapping[str, Any] | None = None,
    append_eos: bool = True,
) -> dict[str, float]:
    """Build the tiny model and fine-tune it until its accuracy on a train probe reaches the target.

    `render` turns a problem into a supervised example (EOS is appended unless `append_eos` is False: a
    chat example ends with its own end-of-turn token), `solve` answers problems with the model (default:
    greedy decoding); `model_kwargs` override `build_tiny_llama`'s arguments (e.g. `chat_tokens`, a longer
    `max_position_embeddings`). Writes an HF checkpoint to `out_dir` (loadable by transformers, the
    embedded engine and SGLang) and returns what happened: steps, seconds, probe accuracy.
    """
    import torch

    from miles_aio.models.tiny import build_tiny_llama, load_tokenizer

    torch.manual_seed(seed)
    shape: dict[str, Any] = {
        "hidden_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 512,
        "max_position_embeddings": 32,
        **(model_kwargs or {}),
    }
    build_tiny_llama(out_dir, alphabet=alphabet, seed=seed, **shape)
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    solve = solve or greedy_solve
    rng = random.Random(seed)
    probe = rng.sample(list(train), min(probe_size, len(train)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0, acc, step = time.monotonic(), 0.0, 0
    for step in range(1, max_steps + 1):
        model.train()
        examples = [render(p) for p in rng.sample(list(train), batch_size)]
        ids, labels = sft_batch(tok, examples, append_eos=append_eos)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check_every == 0:
            model.train(False)
            acc = accuracy(solve(model, tok, probe), probe)
            log.info("warm start", step=step, loss=round(loss.item(), 4), probe_accuracy=acc)
            if acc >= target_accuracy:
                break
    model.save_pretrained(out_dir, safe_serialization=True)
    return {"steps": float(step), "seconds": time.monotonic() - t0, "probe_accuracy": acc}


def accuracy(answers: Sequence[str], problems: Sequence[Problem]) -> float:
    return sum(parse_answer(a) == p.answer for a, p in zip(answers, problems, strict=True)) / len(problems)


def sft_batch(tok: Any, examples: Sequence[list[Segment]], *, append_eos: bool = True) -> tuple[Any, Any]:
    """Token ids and labels (-100 where no loss is taken), right-padded; EOS ends every example unless
    `append_eos` is False."""
    import torch

    rows = []
    for segments in examples:
        ids: list[int] = []
        trained: list[bool] = []
        for text, train_on in segments:
            piece = tok.encode(text)
            ids += piece
            trained += [train_on] * len(piece)
        rows.append(([*ids, tok.eos_token_id], [*trained, True]) if append_eos else (ids, trained))
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, trained) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, trained, strict=True)])
    return ids_t, labels


def greedy_solve(model: Any, tok: Any, problems: Sequence[Problem], max_new: int = 4) -> list[str]:
    """Greedy answers (full recompute; the prompts of two-digit problems all have the same length)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([tok.encode(p.prompt) for p in problems])
        out = ids
        for _ in range(max_new):
            nxt = model(input_ids=out).logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
    eos = tok.eos_token_id
    rows = [row[: row.index(eos)] if eos in row else row for row in out[:, ids.shape[1] :].tolist()]
    return [tok.decode(r) for r in rows]

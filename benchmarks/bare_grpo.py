"""The baseline of `benchmarks.learning`: GRPO in one process, one loop, no runtime. Not the product.

    python -m benchmarks.bare_grpo MODEL_DIR [--steps 300] [--lr 1e-4] [--decoupled-lr 1e-3] [--seed 0]
    python -m benchmarks.bare_grpo WORKDIR --schedules     # the lr-schedule sweep of docs/learning.md
    python -m benchmarks.bare_grpo WORKDIR --filter-sweep  # session 19's zero-std filter rows
    python -m benchmarks.bare_grpo WORKDIR --variant-sweep # session 22's model, batch and optimizer rows
    python -m benchmarks.bare_grpo WORKDIR --width-sweep   # session 23's updates per rollout and widths

What a user comparing miles_aio with "a GRPO script" would write: sample B prompts × n completions at
temperature 1 with a KV cache, score them (exact match), group-normalised advantages, a token-mean
policy-gradient loss (on-policy, so the PPO ratio is 1), one AdamW step, repeat; greedy held-out eval
every `--eval-interval` steps. Same model, task, batch, optimizer and schedule as `recipes.quickstart`,
on all the machine's cores, so its completions/s is the bar the runtime's overhead is measured against.
Prints one JSON object: the eval curve (step, seconds of RL, accuracy) and completions per second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from miles_aio.tasks.arithmetic import Problem, make_splits, parse_answer


def _sample(
    model: Any, ids: torch.Tensor, max_new: int, temperature: float, logps: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """`max_new` tokens per row (KV cache; the two-digit prompts all have the same length); each token's
    log-probability under the sampling distribution goes to `logps` when given (what an engine returns)."""
    out, inp, cache = [], ids, None
    for _ in range(max_new):
        o = model(input_ids=inp, cache=cache, use_cache=True)
        cache, logits = getattr(o, "cache", None) or o.past_key_values, o.logits[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
            if logps is not None:
                logps.append(torch.log_softmax(logits / temperature, -1).gather(-1, nxt))
        out.append(nxt)
        inp = nxt
    return torch.cat(out, 1)


def _until_eos(rows: torch.Tensor, eos: int) -> list[list[int]]:
    """Each row up to and including its first EOS (what an engine returns)."""
    res = []
    for r in rows.tolist():
        res.append(r[: r.index(eos) + 1] if eos in r else r)
    return res


def _answers(tok: Any, rows: list[list[int]]) -> list[str]:
    return [parse_answer(tok.decode([t for t in r if t != tok.eos_token_id])) for r in rows]


@torch.no_grad()
def held_out_accuracy(model: Any, tok: Any, problems: list[Problem], max_new: int = 4) -> float:
    ids = torch.tensor([tok.encode(p.prompt) for p in problems])
    answers = _answers(tok, _until_eos(_sample(model, ids, max_new, 0.0), tok.eos_token_id))
    return sum(a == p.answer for a, p in zip(answers, problems, strict=True)) / len(problems)


def lr_at(step: int, *, top: float, low: float, warmup: int, decay_steps: int | None) -> float:
    """Megatron's schedule as the trainer runs it: linear warmup from 0 to `top`, then cosine to `low`."""
    if warmup and step <= warmup:
        return top * step / warmup
    if decay_steps is None:
        return top
    rho = min(1.0, (step - warmup) / max(decay_steps - warmup, 1))
    return low + (top - low) * 0.5 * (math.cos(math.pi * rho) + 1.0)


MAX_FILTER_ROUNDS = 4
"""With `filter_zero_std`, at most this many more rollouts of a batch's prompts per step."""


Rollout = tuple[list[Problem], torch.Tensor, torch.Tensor, list[list[int]], torch.Tensor, torch.Tensor]
"""One step's sampling: (problems, prompt ids, generated ids, rows up to EOS, rewards [prompts, n], the
generated tokens' sampling log-probs)."""


def _rollout(
    model: Any, tok: Any, rng: random.Random, train: list[Problem], prompts: int, n: int, max_new: int
) -> Rollout:
    """`prompts` random problems × `n` samples at temperature 1."""
    problems = rng.sample(train, prompts)
    ids = torch.tensor([tok.encode(p.prompt) for p in problems]).repeat_interleave(n, 0)
    logps: list[torch.Tensor] = []
    with torch.no_grad():
        gen = _sample(model, ids, max_new, 1.0, logps)
    rows = _until_eos(gen, tok.eos_token_id)
    answers = _answers(tok, rows)
    rewards = torch.tensor([float(a == problems[i // n].answer) for i, a in enumerate(answers)])
    return problems, ids, gen, rows, rewards.view(prompts, n), torch.cat(logps, 1)


def _join(a: Rollout, b: Rollout) -> Rollout:
    return (
        a[0] + b[0], torch.cat([a[1], b[1]]), torch.cat([a[2], b[2]]), a[3] + b[3], torch.cat([a[4], b[4]]),
        torch.cat([a[5], b[5]]),
    )  # fmt: skip


def _select(r: Rollout, groups: list[int], n: int) -> Rollout:
    rows = [g * n + k for g in groups for k in range(n)]
    return (
        [r[0][g] for g in groups],
        r[1][rows],
        r[2][rows],
        [r[3][i] for i in rows],
        r[4][groups],
        r[5][rows],
    )


def run(
    model_dir: Path,
    *,
    steps: int,
    lr: float,
    seed: int = 0,
    prompts_per_step: int = 32,
    n: int = 8,
    max_new: int = 4,
    eval_interval: int = 10,
    warmup: int = 0,
    decay_steps: int | None = None,
    min_lr: float = 0.0,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    betas: tuple[float, float] = (0.9, 0.98),
    clip: float = 1.0,
    threads: int | None = None,
    lr_scale: Mapping[str, float] | None = None,
    kl_steps: int = 0,
    filter_zero_std: bool = False,
    filter_rounds: int = MAX_FILTER_ROUNDS,
    steps_per_rollout: int = 1,
    std_normalization: bool = True,
) -> dict[str, Any]:
    """Train for `steps` steps; `steps_per_rollout` splits each step's groups into that many optimizer
    steps, PPO-clipped (eps 0.2) against the sampling log-probs (the later ones are off-policy);
    `std_normalization` False: Dr. GRPO's advantages (rewards centred per group, not divided by its std);
    `decoupled_lr` / `decoupled_min_lr` (default `min_lr`) are the trainer's --decoupled-lr /
    --decoupled-min-lr (the token embedding and lm_head's own peak and final lr);
    `lr_scale` multiplies the lr of parameters whose name contains a key (the ablation's "which component
    is sensitive"); the first `kl_steps` steps also record how far the update moved the policy:
    KL(before ‖ after) per response token of that step's batch. `filter_zero_std`: the recipe's
    `miles_aio.rollout.filters:reward_nonzero_std` (groups whose rewards are all equal are not trained
    on; a step samples up to `filter_rounds` more batches of prompts to fill its batch, and every
    completion counts in the throughput)."""
    from transformers import AutoModelForCausalLM

    from miles_aio.models.tiny import load_tokenizer

    if steps_per_rollout < 1 or (kl_steps and steps_per_rollout != 1):
        raise ValueError("steps_per_rollout must be >= 1, and 1 with kl_steps (the KL is per rollout)")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train, held_out = make_splits()
    ends = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    groups: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        scale = next((v for k, v in (lr_scale or {}).items() if k in name), 1.0)
        top, low = lr * scale, min_lr * scale
        if decoupled_lr is not None and id(param) in ends:
            top, low = decoupled_lr, min_lr if decoupled_min_lr is None else decoupled_min_lr
        groups.setdefault((top, low), []).append(param)
    opt = torch.optim.AdamW(
        [{"params": ps, "lr": top, "top": top, "low": low} for (top, low), ps in groups.items()],
        lr=lr,
        betas=betas,
        weight_decay=0.0,
    )
    kl: list[float] = []
    curve = [{"step": 0, "seconds": 0.0, "accuracy": held_out_accuracy(model, tok, held_out, max_new)}]
    rl_seconds, completions = 0.0, 0
    rewards_since: list[float] = []

    def eval_point(step: int) -> None:
        if step % eval_interval == 0 or step == steps:
            acc = held_out_accuracy(model, tok, held_out, max_new)  # not counted as RL time
            train_reward = sum(rewards_since) / len(rewards_since)
            curve.append({"step": step, "seconds": rl_seconds, "accuracy": acc, "train_reward": train_reward})
            rewards_since.clear()

    for step in range(1, steps + 1):
        t0 = time.monotonic()
        batch = _rollout(model, tok, rng, train, prompts_per_step, n, max_new)
        completions += prompts_per_step * n
        rewards_since.append(float(batch[4].mean()))
        if filter_zero_std:  # keep the groups whose samples disagree; sample more until a batch is full
            keep = batch[4].std(1) > 0
            for _ in range(filter_rounds):
                if int(keep.sum()) >= prompts_per_step:
                    break
                batch = _join(batch, _rollout(model, tok, rng, train, prompts_per_step, n, max_new))
                completions += prompts_per_step * n
                keep = batch[4].std(1) > 0
            chosen = [i for i in range(len(batch[0])) if keep[i]][:prompts_per_step]
            if not chosen:  # nothing to learn from: no update (the runtime would still be sampling)
                rl_seconds += time.monotonic() - t0
                eval_point(step)
                continue
            batch = _select(batch, chosen, n)
        _problems, ids, gen, rows, rewards, rollout_logp = batch
        centred = rewards - rewards.mean(1, keepdim=True)
        adv = (centred / (rewards.std(1, keepdim=True) + 1e-6) if std_normalization else centred).view(-1)
        mask = torch.zeros(gen.shape, dtype=torch.float32)
        for i, r in enumerate(rows):
            mask[i, : len(r)] = 1.0
        full = torch.cat([ids, gen], 1)
        shares = torch.arange(len(rewards)).tensor_split(steps_per_rollout)
        for k, share in enumerate(shares):  # each update trains its share of the groups (none: no update)
            if not len(share):
                continue
            part = slice(int(share[0]) * n, (int(share[-1]) + 1) * n)
            logits = model(input_ids=full[part]).logits[:, ids.shape[1] - 1 : -1]
            dist = torch.log_softmax(logits.float(), -1)
            logp = dist.gather(-1, gen[part].unsqueeze(-1)).squeeze(-1)
            a, m = adv[part, None], mask[part]
            if steps_per_rollout == 1:  # on-policy: the PPO ratio is 1, so the clip never acts
                loss = -(a * logp * m).sum() / m.sum()
            else:  # later updates are off-policy: PPO-clip against the sampling policy (eps 0.2)
                ratio = torch.exp(logp - rollout_logp[part])
                per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
                loss = (per_token * m).sum() / m.sum()
            opt_step = (step - 1) * steps_per_rollout + k  # a step the filter leaves empty still counts
            for group in opt.param_groups:
                group["lr"] = lr_at(
                    opt_step, top=group["top"], low=group["low"], warmup=warmup, decay_steps=decay_steps
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            opt.step()
        if step <= kl_steps:  # ablation only: its runs report no throughput
            with torch.no_grad():
                after = torch.log_softmax(model(input_ids=full).logits[:, ids.shape[1] - 1 : -1].float(), -1)
                per_token = (dist.detach().exp() * (dist.detach() - after)).sum(-1)
                kl.append(float((per_token * mask).sum() / mask.sum()))
        rl_seconds += time.monotonic() - t0
        eval_point(step)
    return {
        "curve": curve,
        "completions": completions,
        "completions_per_s": completions / rl_seconds,
        "rl_seconds": rl_seconds,
        "kl_per_token": kl,
    }


ABLATION: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (label, build_tiny_llama overrides for the warm start, run() overrides)
    ("transformers' init: every matrix N(0, 0.02)", {}, {}),
    ("  … lr × 0.1 on attention (q, k, v, o)", {}, {"lr_scale": {"self_attn": 0.1}}),
    ("  … lr × 0.1 on the MLPs", {}, {"lr_scale": {"mlp": 0.1}}),
    (
        "  … lr × 0.1 on embeddings, lm_head, norms",
        {},
        {"lr_scale": {"embed_tokens": 0.1, "lm_head": 0.1, "norm": 0.1}},
    ),
    ("  … 20-step lr warmup", {}, {"warmup": 20}),
    ("token embeddings N(0, 1) (torch.nn.Embedding's init)", {"embedding_std": 1.0}, {}),
    ("  … 20-step lr warmup", {"embedding_std": 1.0}, {"warmup": 20}),
    ("torch.nn's init: linear U(±1/√fan_in), embeddings N(0, 1) (the recipes')", {"init": "torch"}, {}),
]


def ablation(
    work: Path, *, steps: int = 100, lr: float = 3e-4, seed: int = 0, only: str = ""
) -> list[dict[str, Any]]:
    """Which part of the tiny Llama makes one Adam step move the policy so far: each row (those whose
    label contains `only`) warm-starts the model (cached per init), then trains `steps` steps at `lr` and
    records the first steps' KL."""
    from miles_aio.tasks.arithmetic import warm_start

    rows = []
    train, _ = make_splits()
    for label, init, overrides in (row for row in ABLATION if only in row[0]):
        model_dir = work / ("model-" + ("-".join(f"{k}={v}" for k, v in sorted(init.items())) or "default"))
        if not (model_dir / "model.safetensors").is_file():
            warm_start(model_dir, train, seed=seed, model_kwargs=init)
        res = run(model_dir, steps=steps, lr=lr, seed=seed, eval_interval=steps, kl_steps=3, **overrides)
        rows.append({"variant": label, "kl_per_token": res["kl_per_token"], "curve": res["curve"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _cosine(lr: float, decoupled: float | None = None, decoupled_min: float | None = None) -> dict[str, Any]:
    """20 warmup steps, then cosine to lr / 10 at step 700; the decoupled group from `decoupled` to
    `decoupled_min`."""
    return {
        "lr": lr, "min_lr": lr / 10, "warmup": 20, "decay_steps": 700,
        "decoupled_lr": decoupled, "decoupled_min_lr": decoupled_min,
    }  # fmt: skip


SCHEDULES: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
    # (label, seed, warm-start overrides, run() overrides): 700 steps each, from the quickstart's warm start
    ("lr 1e-4 constant (session 7's quickstart)", 0, {}, {"lr": 1e-4}),
    ("lr 3e-4, cosine to 3e-5", 0, {}, _cosine(3e-4)),
    ("lr 1e-4, tied embeddings", 0, {"tie_word_embeddings": True}, {"lr": 1e-4}),
    ("lr 1e-4, lm_head and final norm × 10", 0, {}, {"lr": 1e-4, "lr_scale": {"lm_head": 10,
                                                                              "model.norm": 10}}),
    ("lr 1e-4, decoupled 1e-3", 0, {}, {"lr": 1e-4, "decoupled_lr": 1e-3}),
    ("lr 2e-4 → 2e-5, decoupled 2e-3 → 2e-4", 0, {}, _cosine(2e-4, 2e-3, 2e-4)),
    ("lr 3e-4 → 3e-5, decoupled 3e-3 → 3e-4", 0, {}, _cosine(3e-4, 3e-3, 3e-4)),
    ("lr 2e-4 → 2e-5, decoupled 5e-3 → 5e-4 (the quickstart's, over 700 steps)", 0, {},
     _cosine(2e-4, 5e-3, 5e-4)),
    ("lr 2e-4 → 2e-5, decoupled 1e-2 → 5e-4", 0, {}, _cosine(2e-4, 1e-2, 5e-4)),
    ("lr 3e-4 → 3e-5, decoupled 5e-3 → 2.5e-4", 0, {}, _cosine(3e-4, 5e-3, 2.5e-4)),
    ("seed 1: lr 2e-4 → 2e-5, decoupled 5e-3 → 1.25e-4", 1, {}, _cosine(2e-4, 5e-3, 1.25e-4)),
    ("seed 1: lr 1e-4 → 1e-5, decoupled 5e-3 → 5e-4", 1, {}, _cosine(1e-4, 5e-3, 5e-4)),
    ("seed 1: lr 2e-4 → 2e-5, decoupled 2e-3 → 2e-4", 1, {}, _cosine(2e-4, 2e-3, 2e-4)),
]  # fmt: skip


def _quickstart(lr: float, steps: int, **more: Any) -> dict[str, Any]:
    """`recipes.quickstart`'s schedule (warmup, cosine to its --min-lr, its decoupled lr) at `lr`, decayed
    over `steps` steps."""
    from recipes.quickstart import DEFAULTS as q

    return {
        "lr": lr, "min_lr": q["min_lr"], "warmup": q["lr_warmup_iters"], "steps": steps, "decay_steps": steps,
        "decoupled_lr": q["decoupled_lr"], "decoupled_min_lr": q["decoupled_min_lr"], **more,
    }  # fmt: skip


FILTER_SWEEP: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
    # session 19 (docs/learning.md): the seeds that end at 81-85.5% after the quickstart's 1000 steps
    *[(f"seed {s}: defaults over 1600 steps", s, {}, _quickstart(1e-4, 1600)) for s in (1, 2)],
    *[(f"seed {s}: zero-std filter", s, {}, _quickstart(1e-4, 1000, filter_zero_std=True)) for s in (1, 2)],
    *[(f"seed {s}: zero-std filter, lr 2e-4", s, {}, _quickstart(2e-4, 1000, filter_zero_std=True))
      for s in (1, 2)],
]  # fmt: skip


VARIANT_SWEEP: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
    # session 22 (docs/learning.md): what else might lift seeds 1 and 2 (the quickstart's 1000-step schedule)
    *[(f"seed {s}: full multi-head attention (4 KV heads, not 2)", s, {"num_kv_heads": 4},
       _quickstart(1e-4, 1000)) for s in (1, 2)],
    *[(f"seed {s}: zero-std filter, at most 1 more batch per step, lr 2e-4", s, {},
       _quickstart(2e-4, 1000, filter_zero_std=True, filter_rounds=1)) for s in (1, 2)],
    *[(f"seed {s}: 16 prompts x 16 samples", s, {}, _quickstart(1e-4, 1000, prompts_per_step=16, n=16))
      for s in (1, 2)],
    *[(f"seed {s}: 64 prompts x 4 samples", s, {}, _quickstart(1e-4, 1000, prompts_per_step=64, n=4))
      for s in (1, 2)],
    *[(f"seed {s}: 64 prompts x 4 samples, lr 2e-4", s, {},
       _quickstart(2e-4, 1000, prompts_per_step=64, n=4)) for s in (1, 2)],
    *[(f"seed {s}: 64 prompts x 4 samples, cosine over 1600 steps", s, {},
       _quickstart(1e-4, 1600, prompts_per_step=64, n=4)) for s in (1, 2)],
    *[(f"seed {s}: the probe's optimizer (Adam betas 0.9/0.999, no grad clipping)", s, {},
       _quickstart(1e-4, 1000, betas=(0.9, 0.999), clip=0.0)) for s in (1, 2)],
]  # fmt: skip


WIDTH_SWEEP: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
    # session 23 (docs/learning.md): more updates per rollout, Dr. GRPO, and a wider model (the quickstart's
    # 1000-step schedule at lr 1e-4; "hidden" rows warm-start that width, MLP 4x unless they say otherwise)
    *[(f"seed {s}: 2 optimizer steps per rollout (PPO-clip against the sampling policy), cosine over 2000",
       s, {}, {**_quickstart(1e-4, 1000), "decay_steps": 2000, "steps_per_rollout": 2}) for s in (1, 2)],
    *[(f"seed {s}: 4 optimizer steps per rollout, cosine over 4000", s, {},
       {**_quickstart(1e-4, 1000), "decay_steps": 4000, "steps_per_rollout": 4}) for s in (1, 2)],
    *[(f"seed {s}: Dr. GRPO (advantages not divided by the group's std)", s, {},
       _quickstart(1e-4, 1000, std_normalization=False)) for s in (1, 2)],
    *[(f"seed {s}: hidden 192", s, {"hidden_size": 192, "intermediate_size": 768}, _quickstart(1e-4, 1000))
      for s in (1, 2)],
    *[(f"seed {s}: hidden 256 (the quickstart's since session 23)", s,
       {"hidden_size": 256, "intermediate_size": 1024}, _quickstart(1e-4, 1000)) for s in (1, 2)],
    ("seed 2: hidden 256, MLP 512", 2, {"hidden_size": 256, "intermediate_size": 512},
     _quickstart(1e-4, 1000)),
    ("seed 2: hidden 256, 32 prompts x 4 samples", 2, {"hidden_size": 256, "intermediate_size": 1024},
     _quickstart(1e-4, 1000, n=4)),
]  # fmt: skip


def schedules(
    work: Path,
    *,
    only: str = "",
    threads: int = 1,
    rows: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = SCHEDULES,
) -> list[dict[str, Any]]:
    """The schedule sweep: each row (those whose label contains `only`) trains the quickstart's warm start
    (torch.nn's init, stopped at 40% on the training probe, checked every 10 steps; cached per seed and
    overrides; 128 wide, as the quickstart was until session 23, unless the row's overrides say
    `hidden_size`) for 700 steps (unless the row says `steps`), on `threads` threads (two rows can run side
    by side on 2 cores)."""
    from miles_aio.tasks.arithmetic import warm_start

    out = []
    train, _ = make_splits()
    for label, seed, init, overrides in (row for row in rows if only in row[0]):
        tag = "-".join(f"{k}={v}" for k, v in sorted(init.items())) or "default"
        model_dir = work / f"model-seed{seed}-{tag}"
        if not (model_dir / "model.safetensors").is_file():
            kwargs = {"init": "torch", **init}
            warm_start(model_dir, train, target_accuracy=0.4, seed=seed, check_every=10, model_kwargs=kwargs)
        kw: dict[str, Any] = {"steps": 700, "seed": seed, "eval_interval": 50, "threads": threads}
        kw.update(overrides)
        res = run(model_dir, **kw)
        out.append({"schedule": label, "curve": res["curve"], "rl_seconds": res["rl_seconds"]})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--decay-steps", type=int, default=None)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--decoupled-lr", type=float, default=None)
    p.add_argument("--decoupled-min-lr", type=float, default=None)
    p.add_argument(
        "--filter-zero-std", action="store_true", help="train only groups whose rewards differ (DAPO filter)"
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="MODEL_DIR is a work dir: run the init/lr-sensitivity ablation there (100 steps at lr 3e-4)",
    )
    p.add_argument(
        "--schedules",
        action="store_true",
        help="MODEL_DIR is a work dir: run the lr-schedule sweep there (700 steps per row, 1 thread)",
    )
    p.add_argument(
        "--filter-sweep",
        action="store_true",
        help="MODEL_DIR is a work dir: seeds 1 and 2 with the zero-std filter and without (docs/learning.md)",
    )
    p.add_argument(
        "--variant-sweep",
        action="store_true",
        help="MODEL_DIR is a work dir: seeds 1 and 2 under model, batch-shape and optimizer variants",
    )
    p.add_argument(
        "--width-sweep",
        action="store_true",
        help="MODEL_DIR is a work dir: seeds 1 and 2 with more updates per rollout, Dr. GRPO, wider models",
    )
    p.add_argument("--only", default="", help="with a sweep: only the rows whose label contains this")
    a = p.parse_args()
    if a.filter_sweep or a.variant_sweep or a.width_sweep:
        rows = FILTER_SWEEP if a.filter_sweep else VARIANT_SWEEP if a.variant_sweep else WIDTH_SWEEP
        marks = (
            (100, 300, 500, 700, 1000, 1600) if a.filter_sweep else (0, 100, 300, 500, 700, 1000, 1300, 1600)
        )
        for r in schedules(a.model_dir, only=a.only, rows=rows):
            at = {p["step"]: p["accuracy"] for p in r["curve"]}
            accs = " | ".join(f"{at[k]:.1%}" if k in at else "—" for k in marks)
            print(f"| {r['schedule']} | {accs} | {r['rl_seconds']:.0f} |")
        return
    if a.schedules:
        sweep = schedules(a.model_dir, only=a.only)
        print("| schedule | held-out: step 0, 100, 300, 500, 600, 700 | train reward, steps 651–700 |")
        print("|---|---|---|")
        for r in sweep:
            at = {p["step"]: p for p in r["curve"]}
            accs = ", ".join(f"{at[k]['accuracy']:.1%}" for k in (0, 100, 300, 500, 600, 700))
            print(f"| {r['schedule']} | {accs} | {at[700]['train_reward']:.2f} |")
        return
    if a.ablation:
        table = ablation(a.model_dir, only=a.only)
        print("| variant | KL/token, steps 1, 2, 3 | held-out, start → step 100 |\n|---|---|---|")
        for r in table:
            kl = ", ".join(f"{x:.3f}" for x in r["kl_per_token"])
            start, end = r["curve"][0]["accuracy"], r["curve"][-1]["accuracy"]
            print(f"| {r['variant']} | {kl} | {start:.1%} → {end:.1%} |")
        return
    out = run(
        a.model_dir,
        steps=a.steps,
        lr=a.lr,
        seed=a.seed,
        eval_interval=a.eval_interval,
        warmup=a.warmup,
        decay_steps=a.decay_steps,
        min_lr=a.min_lr,
        decoupled_lr=a.decoupled_lr,
        decoupled_min_lr=a.decoupled_min_lr,
        filter_zero_std=a.filter_zero_std,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()

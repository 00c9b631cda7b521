"""Decode throughput of the embedded CPU engine vs transformers' `generate`, same model, same threads.

    python -m benchmarks.engine [--output bench-results/engine.json] [--batch-sizes 1,4,16,64]
                                [--prompt-lens 32,1024] [--new-tokens 64] [--num-threads 1] [--repeats 3]
                                [--model-path DIR | --hidden-size 64 --num-layers 2] [--quick]

One engine process (`launch_local_engines`, `--num-threads T`) and, in this process, the same model dir
loaded with `AutoModelForCausalLM` under `torch.set_num_threads(T)`; HF runs only while the engine is idle.
Both sides sample at temperature 1 from the full distribution (no top-k/top-p) and never stop early
(engine: `ignore_eos` and per-request `max_new_tokens`; HF: `min_new_tokens = max_new_tokens`, KV cache on,
left padding with an attention mask). Every cell (batch size B × prompt length) is measured in two modes:

* equal: every request generates exactly `--new-tokens` tokens;
* mixed: an RL-like long tail, as a rollout pool produces it: `--mixed-waves` × B requests with lognormal
  lengths (`--mixed-p50`, `--mixed-p99`, capped at `--mixed-cap`, deterministic from `--seed` and B), at
  most B in flight. The engine gets each request's own length and the client sends the next request as
  soon as one finishes (continuous batching keeps B running); HF runs them as consecutive static batches
  of B, each until its longest member finishes (max_new_tokens = the batch's max), as `generate` does.

Throughput = useful tokens (the sum of the per-request lengths, the same for both sides) / wall time of the
batch, prefill included: for the engine from sending the B concurrent `/generate` requests (one bare aiohttp
session) to the last response, for HF the `generate` call. Prompts are random tokens, distinct per request
and per repeat; the engine's prefix cache is off (`--prefix-cache-entries 0`): there is nothing to reuse.
Both sides are warmed up first; each cell runs `--repeats` times, engine and HF interleaved, and the
median is reported, with the ratio engine / HF. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import torch

from miles_aio.inference.local_launch import launch_local_engines
from miles_aio.logs import configure_logging
from miles_aio.models import build_tiny_llama

ALPHABET: Final = "abcdefghijklmnopqrstuvwxyz 0123456789+-=.\n"
FIRST_TOKEN: Final = 3
"""Ids below this are <pad>, <s>, </s> in the tiny model; prompts use only ordinary tokens."""
MODES: Final = ("equal", "mixed")
TARGETS: Final = {"equal": (1, 1.0), "mixed": (16, 2.0)}
"""mode → (smallest batch the target applies to, engine / HF ratio to reach)."""
_Z99: Final = 2.3263478740408408  # standard normal quantile at 0.99


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    batch_sizes: list[int]
    prompt_lens: list[int]
    new_tokens: int
    repeats: int
    num_threads: int
    mixed_p50: float
    mixed_p99: float
    mixed_cap: int
    mixed_waves: int
    seed: int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--output", type=Path, default=Path("bench-results/engine.json"))
    add("--batch-sizes", default="1,4,16,64", help="comma-separated (default: %(default)s)")
    add("--prompt-lens", default="32,1024", help="prompt tokens, comma-separated (default: %(default)s)")
    add("--new-tokens", type=int, default=64, help="tokens per request in the equal mode (default: 64)")
    add("--num-threads", type=int, default=1, help="torch threads, engine and HF alike (default: 1)")
    add("--repeats", type=int, default=3, help="runs per cell and side; the median is kept (default: 3)")
    add("--mixed-p50", type=float, default=24.0, help="mixed mode: median length (default: 24)")
    add("--mixed-p99", type=float, default=240.0, help="mixed mode: p99 length (default: 240)")
    add("--mixed-cap", type=int, default=256, help="mixed mode: lengths capped here (default: 256)")
    add(
        "--mixed-waves",
        type=int,
        default=4,
        help="mixed mode: requests per cell = waves x B, at most B in flight (default: 4)",
    )
    add("--seed", type=int, default=0, help="prompts and mixed lengths (default: 0)")
    add("--model-path", type=Path, default=None, help="an HF Llama dir (default: build a tiny one)")
    add(
        "--hidden-size",
        type=int,
        default=64,
        help="the tiny model's hidden size; heads = hidden / 16, kv heads = heads / 2 (default: 64)",
    )
    add("--num-layers", type=int, default=2, help="the tiny model's layers (default: 2)")
    add("--quick", action="store_true", help="a tiny configuration, for a smoke run of a few seconds")
    return p


def mixed_lengths(batch: int, *, p50: float, p99: float, cap: int, seed: int) -> list[int]:
    """Per-request lengths, lognormal with the given median and p99, in [1, cap]; a function of seed, B."""
    sigma = math.log(p99 / p50) / _Z99
    rng = random.Random(seed * 1_000_003 + batch)
    return [min(cap, max(1, round(rng.lognormvariate(math.log(p50), sigma)))) for _ in range(batch)]


def make_prompts(batch: int, prompt_len: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest], prompts right-aligned (what decoder-only generate wants)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


async def engine_batch(
    session: aiohttp.ClientSession,
    url: str,
    prompts: list[list[int]],
    lengths: list[int],
    *,
    concurrency: int | None = None,
) -> float:
    """Wall seconds from sending the requests to the last response; at most `concurrency` in flight
    (a rollout pool's limiter: each finished request's slot goes to the next), default all at once."""
    limit = asyncio.Semaphore(concurrency or len(prompts))
    bodies = [
        json.dumps(
            {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": n,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "sampling_seed": i,
                },
            }
        ).encode()
        for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    headers = {"content-type": "application/json"}

    async def one(body: bytes, n: int) -> None:
        async with limit, session.post(f"{url}/generate", data=body, headers=headers) as resp:
            text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"engine: HTTP {resp.status}: {text[:500]}")
        got = len(json.loads(text)["output_ids"])
        if got != n:
            raise RuntimeError(f"engine returned {got} tokens, asked for {n}")

    started = time.perf_counter()
    await asyncio.gather(*(one(b, n) for b, n in zip(bodies, lengths, strict=True)))
    return time.perf_counter() - started


async def _run_batch(url: str, batch: int, new_tokens: int) -> float:
    """`batch` concurrent requests of `new_tokens` each on a fresh session: the warm-up that
    `benchmarks.sim_validate` borrows. Returns the wall seconds."""
    rng = random.Random(batch)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=batch)) as session:
        return await engine_batch(session, url, make_prompts(batch, 16, 40, rng), [new_tokens] * batch)


def hf_batch(model: Any, prompts: list[list[int]], lengths: list[int], pad_id: int) -> float:
    """Wall seconds of one static-batch `generate` running until the longest request is done."""
    ids, mask = left_pad(prompts, pad_id)
    n = max(lengths)
    started = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=pad_id,
        use_cache=True,
    )
    wall = time.perf_counter() - started
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} tokens, asked for {n}")
    return wall


def load_hf(model_path: Path) -> tuple[Any, int, int]:
    """The model (eval, float32, KV cache on), its vocab size and pad id."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    pad = model.generation_config.pad_token_id
    return model, int(model.config.vocab_size), int(pad if pad is not None else 0)


async def run_cells(model_path: Path, s: Setup) -> list[dict[str, Any]]:
    torch.set_num_threads(s.num_threads)  # here: OpenMP's thread count is per calling thread
    hf_load = asyncio.create_task(asyncio.to_thread(load_hf, model_path))  # while the engine starts
    # Prefix cache off: the prompts are random, so there is nothing to reuse (a chance hit of a token or two
    # would only add KV copies that HF does not make).
    extra = [
        *("--max-running-requests", str(max(s.batch_sizes)), "--prefix-cache-entries", "0"),
        *("--log-level", "WARNING"),
    ]
    async with launch_local_engines(
        model_path, num_engines=1, num_threads=s.num_threads, extra_args=extra
    ) as urls:
        model, vocab, pad_id = await hf_load
        big = max(s.batch_sizes)
        # A bare aiohttp session: the lightest client (httpx's pool is slow with many requests in flight,
        # encode/httpx#3215, and would trickle the batch's requests in).
        connector = aiohttp.TCPConnector(limit=big)
        timeout = aiohttp.ClientTimeout(total=1800.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            url = urls[0]
            rng = random.Random(s.seed)
            # Warm-up: thread pools, first-call allocations, the engine's KV pool grown to the longest prompt.
            for b, plen in ((big, min(s.prompt_lens)), (min(4, big), max(s.prompt_lens))):
                prompts = make_prompts(b, plen, vocab, rng)
                await engine_batch(session, url, prompts, [8] * b)
                hf_batch(model, prompts, [8] * b, pad_id)
            cells: list[dict[str, Any]] = []
            for mode in MODES:
                for plen in s.prompt_lens:
                    for b in s.batch_sizes:
                        waves = 1 if mode == "equal" else s.mixed_waves
                        if mode == "equal":
                            lengths = [s.new_tokens] * b
                        else:
                            lengths = mixed_lengths(
                                b * waves, p50=s.mixed_p50, p99=s.mixed_p99, cap=s.mixed_cap, seed=s.seed
                            )
                        chunks = [slice(w * b, (w + 1) * b) for w in range(waves)]
                        eng_s: list[float] = []
                        hf_s: list[float] = []
                        for _ in range(s.repeats):
                            prompts = make_prompts(b * waves, plen, vocab, rng)
                            eng_s.append(await engine_batch(session, url, prompts, lengths, concurrency=b))
                            hf_s.append(sum(hf_batch(model, prompts[c], lengths[c], pad_id) for c in chunks))
                        useful = sum(lengths)
                        eng_tps = useful / statistics.median(eng_s)
                        hf_tps = useful / statistics.median(hf_s)
                        cells.append(
                            {
                                "mode": mode,
                                "prompt_len": plen,
                                "batch": b,
                                "useful_tokens": useful,
                                "longest": max(lengths),
                                "waves": waves,
                                "hf_computed_tokens": sum(b * max(lengths[c]) for c in chunks),
                                "engine_tokens_per_s": eng_tps,
                                "hf_tokens_per_s": hf_tps,
                                "ratio": eng_tps / hf_tps,
                                "repeats": s.repeats,
                                "engine_wall_s": eng_s,
                                "hf_wall_s": hf_s,
                            }
                        )
                        _print_row(cells[-1])
    return cells


def _print_row(c: dict[str, Any]) -> None:
    print(
        f"{c['mode']:>6} {c['prompt_len']:>7} {c['batch']:>6} {c['useful_tokens']:>7} "
        f"{c['engine_tokens_per_s']:>11.0f} {c['hf_tokens_per_s']:>9.0f} {c['ratio']:>8.2f}",
        flush=True,
    )


def meets_target(c: dict[str, Any]) -> bool | None:
    """True/False where the mode's target applies to this batch size, None where it does not."""
    min_batch, ratio = TARGETS[c["mode"]]
    return None if c["batch"] < min_batch else c["ratio"] >= ratio


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    args = build_parser().parse_args()
    configure_logging("console", "WARNING")  # logs to stderr; stdout is the table and the JSON
    if args.quick:
        setup = Setup(
            batch_sizes=[1, 4],
            prompt_lens=[8],
            new_tokens=8,
            repeats=1,
            num_threads=args.num_threads,
            mixed_p50=3.0,
            mixed_p99=24.0,
            mixed_cap=16,
            mixed_waves=2,
            seed=args.seed,
        )
        hidden, layers, max_pos = 32, 1, 64
    else:
        setup = Setup(
            batch_sizes=_ints(args.batch_sizes),
            prompt_lens=_ints(args.prompt_lens),
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            num_threads=args.num_threads,
            mixed_p50=args.mixed_p50,
            mixed_p99=args.mixed_p99,
            mixed_cap=args.mixed_cap,
            mixed_waves=args.mixed_waves,
            seed=args.seed,
        )
        hidden, layers = args.hidden_size, args.num_layers
        longest = max(setup.prompt_lens) + max(setup.new_tokens, setup.mixed_cap)
        max_pos = max(2048, 1 << (longest - 1).bit_length())
    heads = max(2, hidden // 16)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or build_tiny_llama(
            Path(tmp) / "tiny",
            alphabet=ALPHABET,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads // 2,
            max_position_embeddings=max_pos,
        )
        config = json.loads((model_path / "config.json").read_text())
        model_name = (
            str(args.model_path)
            if args.model_path
            else (
                f"tiny random-init Llama (hidden {hidden}, {layers} layers, {heads} heads, "
                f"{heads // 2} kv heads, vocab {config['vocab_size']})"
            )
        )
        print(f"engine vs HF generate: {model_name}, {setup.num_threads} thread(s), temperature 1")
        head = ("mode", 6), ("prompt", 7), ("batch", 6), ("tokens", 7), ("engine t/s", 11), ("HF t/s", 9)
        print(" ".join(f"{h:>{w}}" for h, w in (*head, ("ratio", 8))))
        started = time.perf_counter()
        cells = asyncio.run(run_cells(model_path, setup))
        elapsed = time.perf_counter() - started
    for c in cells:
        c["meets_target"] = meets_target(c)
    result = {
        "benchmark": "engine",
        "model": model_name,
        "model_config": {
            k: config.get(k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
            )
        },
        "num_threads": setup.num_threads,
        "sampling": "temperature 1, full distribution (no top-k/top-p), no early stop, both sides",
        "new_tokens": setup.new_tokens,
        "repeats": setup.repeats,
        "mixed": {
            "distribution": "lognormal",
            "p50": setup.mixed_p50,
            "p99": setup.mixed_p99,
            "cap": setup.mixed_cap,
            "waves": setup.mixed_waves,
            "seed": setup.seed,
        },
        "targets": {m: {"min_batch": b, "ratio": r} for m, (b, r) in TARGETS.items()},
        "quick": args.quick,
        "elapsed_s": elapsed,
        "machine": {
            "cpu": _cpu_model(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _transformers_version(),
        },
        "code": _provenance(),
        "cells": cells,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{elapsed:.0f} s; wrote {args.output}")


def _provenance() -> dict[str, Any]:
    """Which engine code ran: the git commit of the imported miles_aio, and whether its engine/ is edited."""
    import miles_aio

    pkg = Path(miles_aio.__file__).parent

    def git(*cmd: str) -> str:
        try:
            out = subprocess.run(["git", *cmd], cwd=pkg, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "miles_aio": str(pkg),
        "commit": git("rev-parse", "HEAD") or None,
        "engine_edited": bool(git("status", "--porcelain", "--", "engine")),
    }


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


if __name__ == "__main__":
    main()

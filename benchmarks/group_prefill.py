"""What prefilling a GRPO group's prompt once saves the embedded engine, at the quickstart's shape.

    python -m benchmarks.group_prefill [--groups 32] [--n 8] [--prompt-len 6] [--new-tokens 4] [--repeats 12]
                                       [--output bench-results/group_prefill.json]

In this process: the real scheduler (`LocalEngine`) and runner, one compute thread, on a tiny Llama of the
quickstart's shape until session 23 (hidden 128, 2 layers, character vocabulary; this benchmark's figures
were measured with it). Each batch is `--groups` random prompts
× `--n` samples, all queued at once; the batch's wall time is from queueing to its last answer. Batches
alternate between two in-batch sharing thresholds (`miles_aio.engine.core._SHARE_MIN_TOKENS`): SGLang's
32, under which a short prompt is prefilled by every sample of its group, and this engine's 2, under which
the group's first sample prefills it and the others start a step later from its cached KV. Prints the
median of each and their ratio (the machine is noisy: compare within one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from miles_aio.engine import core
from miles_aio.engine.core import LocalEngine
from miles_aio.engine.model import LlamaModel
from miles_aio.engine.runner import ModelRunner
from miles_aio.engine.sampling import SamplingParams
from miles_aio.models import build_tiny_llama

THRESHOLDS = {"sglang (32)": 32, "embedded (2)": 2}


async def batch(engine: LocalEngine, rng: random.Random, a: argparse.Namespace, vocab: int) -> float:
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.groups)]
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [
        engine.new_request(rid=f"{rng.getrandbits(64):x}", prompt_ids=p, params=params)
        for p in prompts
        for _ in range(a.n)
    ]
    await asyncio.gather(*(engine.generate(r) for r in reqs))
    return time.perf_counter() - t0


async def measure(model: LlamaModel, a: argparse.Namespace) -> dict[str, list[float]]:
    runner = ModelRunner(model, max_running=a.groups * a.n, context_len=64)
    seconds: dict[str, list[float]] = {name: [] for name in THRESHOLDS}
    rng = random.Random(0)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-compute") as pool:
        engine = LocalEngine(
            runner,
            executor=pool,
            detokenize=lambda ids: "",
            context_len=64,
            weight_version="1",
            prefix_cache_entries=2 * a.groups,
            seed=0,
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(engine.run(), name="engine")
            for rep in range(a.repeats + 1):  # the first round warms up
                for name, threshold in THRESHOLDS.items():
                    core._SHARE_MIN_TOKENS = threshold  # type: ignore[misc]  # the one knob compared
                    s = await batch(engine, rng, a, model.spec.vocab_size)
                    if rep:
                        seconds[name].append(s)
            engine.close()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=6, help="tokens per prompt (quickstart: 6)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--output", type=Path, default=None, help="write the results here (JSON)")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "m", alphabet="0123456789+=")
        model = LlamaModel.load(model_dir, context_len=64)
        seconds = asyncio.run(measure(model, a))
    med = {name: statistics.median(v) for name, v in seconds.items()}
    print(f"{a.groups} prompts of {a.prompt_len} tokens × {a.n} samples, {a.new_tokens} new tokens each:")
    for name, m in med.items():
        print(f"  threshold {name:13s} {m * 1000:7.1f} ms per batch (median of {a.repeats})")
    base, ours = med["sglang (32)"], med["embedded (2)"]
    print(f"  ratio embedded / sglang: {ours / base:.2f}")
    if a.output is not None:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        shape = {k: getattr(a, k) for k in ("groups", "n", "prompt_len", "new_tokens", "repeats")}
        a.output.write_text(json.dumps({**shape, "median_s": med, "ratio": ours / base}, indent=1))


if __name__ == "__main__":
    main()

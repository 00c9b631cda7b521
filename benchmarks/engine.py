"""Decode throughput of the embedded CPU engine, end to end over HTTP.

    python -m benchmarks.engine [--output bench-results/engine.json] [--batch-sizes 1,4,16,64]
                                [--new-tokens 64] [--num-threads 1] [--model-path DIR]

Builds the default tiny Llama (hidden 128, 2 layers, char vocab) in a temp dir unless `--model-path` is
given, starts one engine with `launch_local_engines`, and for each batch size B sends B concurrent
`/generate` requests (distinct 16-token prompts, `ignore_eos`, temperature 1, `--new-tokens` each). The
engine decodes them as one continuous batch. Reported per B: wall time, decode tokens/s (B × new tokens /
wall), and per-request latency. One warm-up request runs first. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from miles_aio.inference.local_launch import launch_local_engines
from miles_aio.logs import configure_logging
from miles_aio.models import build_tiny_llama

PROMPT_LEN = 16
ALPHABET = "abcdefghijklmnopqrstuvwxyz 0123456789+-=.\n"


async def _run_batch(url: str, batch: int, new_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=batch, max_keepalive_connections=batch)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:

        async def one(i: int) -> float:
            body = {
                "input_ids": [3 + (i * 7 + j) % 40 for j in range(PROMPT_LEN)],
                "sampling_params": {
                    "max_new_tokens": new_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "sampling_seed": i,
                },
                "return_logprob": True,
            }
            t0 = time.perf_counter()
            resp = await client.post("/generate", json=body)
            resp.raise_for_status()
            assert len(resp.json()["output_ids"]) == new_tokens
            return time.perf_counter() - t0

        started = time.perf_counter()
        latencies = await asyncio.gather(*(one(i) for i in range(batch)))
        wall = time.perf_counter() - started
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "wall_s": wall,
        "decode_tokens_per_s": batch * new_tokens / wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
    }


async def _bench(
    model_path: Path, batch_sizes: list[int], new_tokens: int, num_threads: int
) -> list[dict[str, Any]]:
    extra = ["--max-running-requests", str(max(batch_sizes)), "--log-level", "WARNING"]
    async with launch_local_engines(
        model_path, num_engines=1, num_threads=num_threads, extra_args=extra
    ) as urls:
        await _run_batch(urls[0], 1, 8)  # warm-up: first-call allocations, thread pools
        return [await _run_batch(urls[0], b, new_tokens) for b in batch_sizes]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=Path("bench-results/engine.json"))
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument(
        "--model-path", type=Path, default=None, help="an HF Llama dir (default: build the tiny one)"
    )
    args = p.parse_args()
    configure_logging("console", "WARNING")  # logs to stderr; stdout is the table and the JSON
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or build_tiny_llama(Path(tmp) / "tiny", alphabet=ALPHABET)
        rows = asyncio.run(_bench(model, batch_sizes, args.new_tokens, args.num_threads))

    print(
        f"embedded engine decode throughput ({model if args.model_path else 'tiny Llama 128x2'}, "
        f"{args.num_threads} thread(s), HTTP end to end)"
    )
    print(f"{'batch':>6} {'wall s':>8} {'decode tok/s':>13} {'p50 latency s':>14} {'max latency s':>14}")
    for r in rows:
        print(
            f"{r['batch']:>6} {r['wall_s']:>8.2f} {r['decode_tokens_per_s']:>13.0f} "
            f"{r['latency_p50_s']:>14.2f} {r['latency_max_s']:>14.2f}"
        )
    result = {
        "benchmark": "engine",
        "model": str(args.model_path) if args.model_path else "tiny-llama-128x2",
        "num_threads": args.num_threads,
        "prompt_len": PROMPT_LEN,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "results": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

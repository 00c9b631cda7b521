"""Weight-sync cost vs model size for each transfer mode, and trainer throughput, on CPU.

    python -m benchmarks.weight_sync [--output bench-results/weight_sync.json] [--sizes 64x2,256x4,512x8]
                                     [--repeats 3] [--train-steps 3]

For each model size (hidden × layers; tiny random-init Llamas, char vocabulary) it starts one embedded
engine and a one-rank `TrainerActor`, then times `TrainerActor.sync_weights` end to end:
  broadcast  rank 0 → engine over a gloo weight-update group (SGLang's /update_weights_from_distributed),
             in buckets of --update-weight-buffer-size (default 512 MiB: one bucket here);
  disk       rank 0 writes an HF safetensors snapshot, the engine loads it (/update_weights_from_disk).
The disk time is compared with the raw cost of writing and reading back the same tensors with
safetensors in this process (`disk ratio` = sync / raw: what the protocol adds on top of the file I/O).
Trainer throughput: prompt+response tokens per second of `train()` on a synthetic batch (8 prompts ×
8 samples, 32-token prompts, 64-token responses), whole step including the π_old recompute. The first
sync and step of each size are warm-ups and not timed. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from miles_aio.inference.local_launch import launch_local_engines
from miles_aio.inference.router import EngineRouter
from miles_aio.logs import configure_logging
from miles_aio.models import build_tiny_llama
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig
from miles_aio.types import Group, Sample, Status

ALPHABET = "abcdefghijklmnopqrstuvwxyz 0123456789+-=.\n"


def _batch(vocab: int, *, groups: int = 8, n: int = 8, prompt: int = 32, response: int = 64) -> list[Group]:
    rng = random.Random(0)
    out: list[Group] = []
    for g in range(groups):
        out.append([
            Sample(group_index=g, index=g * n + k, prompt="", status=Status.COMPLETED,
                   tokens=[rng.randrange(3, vocab) for _ in range(prompt + response)],
                   response_length=response, loss_mask=[1] * response, rollout_log_probs=[-3.0] * response,
                   weight_versions=[1] * response, reward=float(rng.random() < 0.5))
            for k in range(n)
        ])  # fmt: skip
    return out


def _raw_safetensors_s(tensors: dict[str, Any], directory: Path) -> float:
    path = directory / "raw.safetensors"
    t0 = time.perf_counter()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    load_file(str(path))
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


async def _bench_size(hidden: int, layers: int, root: Path, repeats: int, train_steps: int) -> dict[str, Any]:
    model = build_tiny_llama(root / f"m{hidden}x{layers}", alphabet=ALPHABET, hidden_size=hidden,
                             num_layers=layers, num_heads=max(4, hidden // 64), num_kv_heads=2)  # fmt: skip
    vocab = len(ALPHABET) + 3
    cfg = TrainConfig(hf_checkpoint=model, lr=1e-5, use_tis=True, micro_batch_size=8,
                      update_weight_transfer_mode="broadcast")  # fmt: skip
    row: dict[str, Any] = {"hidden": hidden, "layers": layers}
    async with (
        launch_local_engines(model, num_engines=1, weights_root=root, num_threads=1) as urls,
        EngineRouter.open(urls) as router,
        TrainerActor.open(cfg, run_dir=root / f"run{hidden}x{layers}") as actor,
    ):
        weights = await actor.get_weights()
        row["params"] = sum(t.numel() for t in weights.values())
        row["mbytes"] = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
        version = 0
        for mode in ("broadcast", "disk"):
            actor.cfg = dataclasses.replace(cfg, update_weight_transfer_mode=mode)
            times = []
            for i in range(repeats + 1):
                version += 1
                t0 = time.perf_counter()
                await actor.sync_weights(router, version=version)
                if i:  # the first one joins the group / warms the page cache
                    times.append(time.perf_counter() - t0)
            row[f"{mode}_s"] = statistics.median(times)
        row["raw_safetensors_s"] = statistics.median(
            _raw_safetensors_s(weights, root) for _ in range(repeats)
        )
        row["disk_ratio"] = row["disk_s"] / row["raw_safetensors_s"]
        batch = _batch(vocab)
        rates = []
        for step in range(train_steps + 1):
            m = await actor.train(step, batch)
            if step:
                rates.append(m["perf/trainer_tokens_per_s"])
        row["trainer_tokens_per_s"] = statistics.median(rates)
    return row


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=Path("bench-results/weight_sync.json"))
    p.add_argument("--sizes", default="64x2,256x4,512x8", help="comma-separated HIDDENxLAYERS")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per mode (after one warm-up)")
    p.add_argument("--train-steps", type=int, default=3, help="timed train steps (after one warm-up)")
    args = p.parse_args()
    configure_logging("console", "WARNING")  # logs to stderr; stdout is the table and the JSON
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden, layers in sizes:
            rows.append(asyncio.run(_bench_size(hidden, layers, Path(tmp), args.repeats, args.train_steps)))

    print("weight sync, one CPU trainer rank → one embedded engine (median seconds per sync)")
    print(f"{'model':>8} {'params':>10} {'MiB':>7} {'broadcast s':>12} {'disk s':>8} {'raw st s':>9} "
          f"{'disk ratio':>11} {'train tok/s':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['hidden']:>4}x{r['layers']:<3} {r['params']:>10} {r['mbytes']:>7.1f} "
              f"{r['broadcast_s']:>12.3f} {r['disk_s']:>8.3f} {r['raw_safetensors_s']:>9.3f} "
              f"{r['disk_ratio']:>11.1f} {r['trainer_tokens_per_s']:>12.0f}")  # fmt: skip
    result = {
        "benchmark": "weight_sync",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "train_batch": {"prompts": 8, "samples_per_prompt": 8, "prompt_len": 32, "response_len": 64},
        "results": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Figures for the GPU checks: trainer step time and weight-sync time on CUDA, per backend.

    python tests/gpu/gpu_report.py [--output gpu_report.json]

Runs the real TrainerActor (rank processes, CUDA) on a small Llama (hidden 1024, 8 layers, ~0.1B
parameters) for a few steps with each backend (and megatron with PP=2 when there are 2 GPUs), and
times a disk weight sync (safetensors written for the engines). Not a test: a report, run by hand on a
GPU machine (the tests are test_gpu_trainer.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles_aio.models.tiny import build_tiny_llama
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainBackend, TrainConfig
from miles_aio.types import Group, Sample, Status

ALPHABET = "0123456789+=abcdefghijklmnopqrstuvwxyz"


def batch(seed: int, groups: int = 8, n: int = 8, prompt: int = 64, response: int = 192) -> list[Group]:
    rng = random.Random(seed)
    vocab = len(ALPHABET) + 3
    out: list[Group] = []
    for g in range(groups):
        group: Group = []
        for k in range(n):
            tokens = [rng.randrange(3, vocab) for _ in range(prompt + response)]
            group.append(
                Sample(group_index=g, index=g * n + k, prompt="", tokens=tokens, response_length=response,
                       loss_mask=[1] * response, rollout_log_probs=[-3.0] * response,
                       weight_versions=[1] * response, reward=float(rng.random() < 0.5),
                       status=Status.COMPLETED)
            )  # fmt: skip
        out.append(group)
    return out


async def measure(cfg: TrainConfig, run_dir: Path, steps: int) -> dict[str, Any]:
    async with TrainerActor.open(cfg, run_dir=run_dir) as actor:
        await actor.train(0, batch(0))  # warm-up (allocator, kernels)
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            metrics = await actor.train(s, batch(s))
        step_s = (time.perf_counter() - t0) / steps
        t1 = time.perf_counter()
        await actor.write_weights(1)
        sync_s = time.perf_counter() - t1
        tokens = sum(x.response_length + x.prompt_length for g in batch(0) for x in g)
        return {
            "backend": cfg.train_backend,
            "wrapper": actor.wrapper,
            "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens / step_s),
            "disk_sync_s": round(sync_s, 4),
            "loss": metrics.get("train/loss"),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path, default=Path("gpu_report.json"))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(
            Path(tmp) / "model",
            alphabet=ALPHABET,
            hidden_size=1024,
            num_layers=8,
            num_heads=16,
            num_kv_heads=4,
            max_position_embeddings=512,
        )
        params = sum(
            p.numel()
            for p in __import__("safetensors.torch").torch.load_file(model / "model.safetensors").values()
        )
        rows: list[dict[str, Any]] = []
        runs: list[tuple[TrainBackend, dict[str, Any]]] = [("fsdp", {}), ("megatron", {})]
        if torch.cuda.device_count() >= 2:  # one GPU per pipeline stage
            runs.append(("megatron", {"pipeline_model_parallel_size": 2, "actor_num_gpus_per_node": 2}))
        else:
            rows.append(
                {"backend": "megatron pp=2", "skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
            )
        for i, (backend, extra) in enumerate(runs):
            cfg = TrainConfig(
                hf_checkpoint=model,
                lr=1e-5,
                use_tis=True,
                micro_batch_size=16,
                train_backend=backend,
                **extra,
            )
            try:
                rows.append(asyncio.run(measure(cfg, Path(tmp) / f"{backend}{i}", args.steps)))
            except Exception as e:  # report, don't hide: the failure is the figure
                rows.append({"backend": backend, **extra, "error": repr(e)[:2000]})
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "parameters": params,
        "batch": "64 samples x 256 tokens",
        "rows": rows,
    }
    args.output.write_text(json.dumps(report, indent=2))
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

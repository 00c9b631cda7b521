"""Helpers for the trainer tests: a tiny HF Llama on disk and synthetic rollout batches."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from miles_aio.models.tiny import build_tiny_llama
from miles_aio.trainer.config import TrainConfig
from miles_aio.types import Group, Sample, Status

T = TypeVar("T")
ALPHABET = "0123456789+="
VOCAB = len(ALPHABET) + 3  # + <pad> <s> </s>


def tiny_model(directory: Path, *, seed: int = 0) -> Path:
    return build_tiny_llama(directory, alphabet=ALPHABET, hidden_size=64, num_layers=2, seed=seed)


def make_batch(
    seed: int,
    *,
    groups: int = 2,
    n: int = 4,
    prompt_len: int = 4,
    max_resp: int = 5,
    shared_prompt: bool = False,
) -> list[Group]:
    """Random prompt/response ids with binary rewards and made-up rollout log-probs; with `shared_prompt`
    the samples of a group share their prompt (as a GRPO group's do), else each has its own."""
    rng = random.Random(seed)
    batch: list[Group] = []
    for g in range(groups):
        group: Group = []
        shared = [rng.randrange(3, VOCAB) for _ in range(prompt_len)] if shared_prompt else None
        for k in range(n):
            prompt = shared or [rng.randrange(3, VOCAB) for _ in range(prompt_len)]
            r = rng.randrange(1, max_resp + 1)
            group.append(
                Sample(
                    group_index=g,
                    index=g * n + k,
                    prompt="",
                    tokens=prompt + [rng.randrange(3, VOCAB) for _ in range(r)],
                    response_length=r,
                    loss_mask=[1] * r,
                    rollout_log_probs=[-rng.uniform(1.5, 3.5) for _ in range(r)],
                    weight_versions=[1] * r,
                    reward=float(rng.random() < 0.5),
                    status=Status.COMPLETED,
                )
            )
        batch.append(group)
    return batch


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(") ", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def train_cfg(model_dir: Path, **kw: object) -> TrainConfig:
    """The small CPU training config the actor tests share (TIS on, 2 optimizer steps per train)."""
    base: dict[str, object] = {
        "hf_checkpoint": model_dir,
        "lr": 1e-3,
        "use_tis": True,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "clip_grad": 1.0,
    }
    return TrainConfig(**(base | kw))  # type: ignore[arg-type]

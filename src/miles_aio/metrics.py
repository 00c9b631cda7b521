"""Per-step metrics: one flat dict per step, sent to every sink. `metrics.jsonl` is always written."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from itertools import compress
from pathlib import Path
from typing import IO, Protocol

from miles_aio.types import Group, Sample, Status, group_staleness

__all__ = [
    "JsonlSink",
    "MetricsSink",
    "brief",
    "reward_value",
    "rollout_batch_metrics",
    "token_staleness_histogram",
]


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """`<run-dir>/metrics.jsonl`: one JSON object per step, with `step` and every metric."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def reward_value(r: object, key: str | None = None) -> float | None:
    """A reward as a number for the metrics: the value itself, or a dict's `key` (--reward-key, the
    trained scalar) entry, else its "reward" or "score" entry; None when there is none."""
    if isinstance(r, int | float):
        return float(r)
    if isinstance(r, dict):
        v = r.get(key) if key is not None and key in r else r.get("reward", r.get("score"))
        return float(v) if isinstance(v, int | float) else None
    return None


STALENESS_BUCKETS = ("0", "1", "2", "3", "4+")


def token_staleness_histogram(samples: Iterable[Sample], *, version: int | None) -> dict[str, float]:
    """Fraction of trained tokens (loss_mask 1, known version) by staleness against `version`."""
    counts = dict.fromkeys(STALENESS_BUCKETS, 0)
    total = 0
    if version is not None:
        by_version: Counter[int] = Counter()  # counted in C: a 10k-sample batch is ~10 ms, not ~300
        for s in samples:
            if len(s.loss_mask) != len(s.weight_versions):
                raise ValueError(f"sample {s.index}: loss_mask and weight_versions lengths differ")
            by_version.update(compress(s.weight_versions, s.loss_mask))  # type: ignore[arg-type]
        by_version.pop(None, None)  # type: ignore[call-overload]
        for v, c in by_version.items():
            counts[STALENESS_BUCKETS[min(version - v, 4)]] += c
            total += c
    return {f"rollout/token_staleness/{k}": c / total if total else 0.0 for k, c in counts.items()}


def rollout_batch_metrics(
    batch: Iterable[Group], *, version: int | None, reward_key: str | None = None
) -> dict[str, float]:
    """rollout/* metrics of one training batch: reward (a dict reward's `reward_key` entry), lengths,
    statuses, the share of response tokens the model generated (loss_mask 1; the rest is context such as
    tool output, at loss_mask 0).

    `train_staleness_*` (train staleness) is measured against the policy about to be trained on the batch
    (`version`), which is one push later than the drain-time consume staleness in rollout/fully_async/*
    under prefetch; absent, not 0, when no group's staleness is known (no version yet).
    """
    samples = [s for g in batch for s in g]
    groups = list(batch)
    rewards = [v for s in samples if (v := reward_value(s.reward, reward_key)) is not None]
    lengths = [s.response_length for s in samples]
    model_tokens = sum(sum(s.loss_mask) for s in samples)
    stale = [st for g in groups if (st := group_staleness(g, version)) is not None]
    n = max(1, len(samples))
    hist = token_staleness_histogram(samples, version=version)
    metrics = hist | {
        "rollout/reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "rollout/response_len": sum(lengths) / n,
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "rollout/samples": float(len(samples)),
        "rollout/tokens": float(sum(lengths)),
        "rollout/model_token_ratio": model_tokens / sum(lengths) if sum(lengths) else 0.0,
    }
    if stale:  # unknown staleness is absent, never 0
        metrics["rollout/train_staleness_mean"] = sum(stale) / len(stale)
        metrics["rollout/train_staleness_max"] = float(max(stale))
    return metrics


def brief(metrics: dict[str, float]) -> dict[str, float]:
    """The few numbers worth a log line per step (staleness: the consume staleness, at drain time)."""
    keys = {
        "rollout/reward": "reward",
        "rollout/fully_async/avg_staleness": "consume_staleness",
        "perf/step_time_s": "step_time_s",
        "rollout/fully_async/queue_size": "queue_size",
    }
    return {name: round(metrics[k], 4) for k, name in keys.items() if k in metrics}

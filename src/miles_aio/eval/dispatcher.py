"""`EvalDispatcher`: when eval points run, on which weights, and when their metrics are logged.

A point is due after the push that follows every `--eval-interval`-th step (and once on the initial
weights unless `--skip-eval-before-train`). Its `eval/step` is the number of training steps behind the
weights it evaluates. The point runs as a task in the controller's TaskGroup:
  consumes: the current policy version (engines already stamped)
  produces: an `EvalPointResult` (eval/* metrics and the point's samples), handed out by `collect()`
            with the first step record written after it finishes, with `eval/lag_steps` = steps
            trained meanwhile
  waits for: the engines (eval requests sit above rollout ones in the limiter)
  blocks:   the next weight push, which waits for the point so that it sees one version
            (`wait_before_push()`; the wait is `eval/push_wait_seconds` and `perf/eval_stall_seconds`)
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from miles_aio.types import Sample

__all__ = ["EvalDispatcher", "EvalPointResult", "EvalPoints", "EvalReport", "Evaluator", "point_samples"]

log = structlog.get_logger("miles_aio.eval")


class Evaluator(Protocol):
    async def evaluate(self) -> dict[str, float]: ...


@dataclass(frozen=True, slots=True)
class EvalPointResult:
    """One finished eval point: its `eval/*` metrics (with `eval/step`, `eval/version`) and, when the
    evaluator generated them itself (modes 1 and 2), its samples by dataset."""

    metrics: dict[str, float]
    samples: Mapping[str, Sequence[Sample]] | None = None


@dataclass(frozen=True, slots=True)
class EvalReport:
    """What `collect()` hands to one step record: the points finished since the last call (in the order
    they finished) and the skip counters (`eval/skipped_<reason>`) of points skipped meanwhile."""

    points: list[EvalPointResult] = field(default_factory=list)
    skipped: dict[str, float] = field(default_factory=dict)

    def step_metrics(self) -> dict[str, float]:
        """The step record's eval/* metrics: the newest point's (every point also gets its own line in
        `eval_points.jsonl`) and the skip counters."""
        out: dict[str, float] = {}
        for point in self.points:
            out.update(point.metrics)
        return out | self.skipped


def point_samples(evaluator: object) -> Mapping[str, Sequence[Sample]] | None:
    """The samples of the evaluator's last point (`last_samples`), if it keeps them."""
    samples = getattr(evaluator, "last_samples", None)
    return samples if isinstance(samples, Mapping) else None


class EvalPoints(Protocol):
    """What the controller drives: `EvalDispatcher` (mode 1) and `SnapshotEvalDispatcher` (modes 2, 3)."""

    points: int

    def due(self, steps_done: int) -> bool: ...

    def dispatch(self, tg: asyncio.TaskGroup, *, steps_done: int, version: int) -> None: ...

    async def wait_before_push(self, *, steps_done: int) -> float: ...

    def collect(self) -> EvalReport: ...


class EvalDispatcher:
    def __init__(self, evaluator: Evaluator, *, interval: int | None, before_train: bool = True) -> None:
        self._evaluator = evaluator
        self._interval = interval
        self._before_train = before_train
        self._task: asyncio.Task[dict[str, float]] | None = None
        self._point: tuple[int, int] | None = None  # (eval step, version) of the point in flight
        self._ready: list[EvalPointResult] = []
        self.points = 0

    def due(self, steps_done: int) -> bool:
        if steps_done == 0:
            return self._before_train
        return self._interval is not None and steps_done % self._interval == 0

    def dispatch(self, tg: asyncio.TaskGroup, *, steps_done: int, version: int) -> None:
        """Start a point on the weights just pushed (call right after the push)."""
        if self._task is not None:
            raise RuntimeError("an eval point is still in flight; wait_before_push() first")
        self._point = (steps_done, version)
        self._task = tg.create_task(self._evaluator.evaluate(), name=f"eval-step-{steps_done}")

    async def wait_before_push(self, *, steps_done: int) -> float:
        """Let the point in flight finish on the current weights; returns the seconds waited."""
        if self._task is None:
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        metrics = await self._task
        waited = loop.time() - t0
        assert self._point is not None
        step, version = self._point
        metrics.update(
            {
                "eval/step": float(step),
                "eval/version": float(version),
                "eval/lag_steps": float(steps_done - step),
                "eval/push_wait_seconds": waited,
            }
        )
        log.info(
            "eval point",
            step=step,
            version=version,
            **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items() if "accuracy" in k},
        )
        self._ready.append(EvalPointResult(metrics, point_samples(self._evaluator)))
        self._task, self._point = None, None
        self.points += 1
        return waited

    def collect(self) -> EvalReport:
        """The point finished since the last call, if any (each point is handed out once)."""
        ready, self._ready = self._ready, []
        return EvalReport(points=ready)

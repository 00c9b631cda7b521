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
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from miles_aio.types import Sample

__all__ = [
    "EvalDispatcher",
    "EvalPointResult",
    "EvalPoints",
    "EvalReport",
    "Evaluator",
    "NoEval",
    "eval_due",
    "point_samples",
]

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


def eval_due(steps_done: int, interval: int | None, *, final_step: int | None, before_train: bool) -> bool:
    """Whether an eval point falls after `steps_done` steps: on the initial weights (unless
    --skip-eval-before-train), every --eval-interval steps, and after the last step (as miles: the
    curve ends on the final model). Both dispatchers schedule by it."""
    if steps_done == 0:
        return before_train
    return interval is not None and (steps_done % interval == 0 or steps_done == final_step)


class NoEval:
    """The `EvalPoints` of a run without eval: never due, nothing to wait for or collect."""

    points = 0

    def due(self, steps_done: int) -> bool:
        return False

    def dispatch(self, tg: asyncio.TaskGroup, *, steps_done: int, version: int) -> None:
        raise RuntimeError("this run has no eval")

    async def wait_before_push(self, *, steps_done: int) -> float:
        return 0.0

    def collect(self) -> EvalReport:
        return EvalReport()


class EvalDispatcher:
    def __init__(
        self,
        evaluator: Evaluator,
        *,
        interval: int | None,
        final_step: int | None = None,
        before_train: bool = True,
    ) -> None:
        self._evaluator = evaluator
        self._interval = interval
        self._final_step = final_step
        self._before_train = before_train
        self._task: asyncio.Task[dict[str, float] | None] | None = None
        self._skipped: Counter[str] = Counter()
        self._point: tuple[int, int] | None = None  # (eval step, version) of the point in flight
        self._ready: list[EvalPointResult] = []
        self.points = 0

    def due(self, steps_done: int) -> bool:
        return eval_due(
            steps_done, self._interval, final_step=self._final_step, before_train=self._before_train
        )

    def dispatch(self, tg: asyncio.TaskGroup, *, steps_done: int, version: int) -> None:
        """Start a point on the weights just pushed (call right after the push)."""
        if self._task is not None:
            raise RuntimeError("an eval point is still in flight; wait_before_push() first")
        self._point = (steps_done, version)
        self._task = tg.create_task(self._evaluate(steps_done), name=f"eval-step-{steps_done}")

    async def _evaluate(self, steps_done: int) -> dict[str, float] | None:
        """The point's metrics, or None if the eval crashed: the point is skipped (`eval/skipped_crashed`,
        as in modes 2 and 3) and training goes on. Cancellation propagates."""
        try:
            return await self._evaluator.evaluate()
        except Exception:
            log.exception("eval point crashed: skipped", step=steps_done)
            return None

    async def wait_before_push(self, *, steps_done: int) -> float:
        """Let the point in flight finish on the current weights; returns the seconds waited."""
        if self._task is None:
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await self._task
        waited = loop.time() - t0
        assert self._point is not None
        step, version = self._point
        self._task, self._point = None, None
        if result is None:
            self._skipped["crashed"] += 1
            return waited
        metrics = result
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
        self.points += 1
        return waited

    def collect(self) -> EvalReport:
        """The point finished since the last call, if any (each point is handed out once), and the count
        of points skipped meanwhile."""
        ready, self._ready = self._ready, []
        skipped = {f"eval/skipped_{reason}": float(n) for reason, n in self._skipped.items()}
        self._skipped.clear()
        return EvalReport(points=ready, skipped=skipped)

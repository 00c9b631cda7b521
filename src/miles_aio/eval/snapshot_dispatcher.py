"""`SnapshotEvalDispatcher`: fire-and-forget eval points on HF snapshots (modes 2 and 3).

Points are due as in mode 1 (after the push that follows every `--eval-interval`-th step, and on the
initial weights unless `--skip-eval-before-train`); `eval/step` is the steps trained for the weights.

Per point:
  taking the snapshot  in `wait_before_push(steps_done)` of a due step, i.e. on the controller's path
                       before the next training step, so the trainer's weights are still those of the
                       point (the export is the only blocking part; the pre-train point takes its own
                       snapshot in its task, which runs before the first training step can start).
                       Overflow (`--eval-max-in-flight` points pending): `backpressure` waits here for
                       the oldest pending point, `skip` logs `eval/skipped_busy` instead.
  the point task       started by `dispatch()` in the controller's TaskGroup. Consumes: the snapshot.
                       Waits for: the eval lock (evaluations run one at a time; max-in-flight only lets
                       exports go ahead) and the evaluator. Produces: its metrics, queued for
                       `collect()` with `eval/lag_steps` = steps trained meanwhile. Never fails the run:
                       `EvalSkip(reason)` → `eval/skipped_<reason>`, any other exception →
                       `eval/skipped_crashed` (CancelledError propagates). Then its exported snapshot is
                       handed to the `SnapshotRetirer`, in a task of its own (the trainer's rank 0
                       deletes it, after the command it is running), so the point settles at once.
Weight pushes never wait for points; only the final step's `wait_before_push` awaits every pending one,
so the last points land in the last record (several points settling in one step window are merged
there: the newest wins; every point is kept in `results`). Points fall on pushes (the config requires
`--eval-interval` to be a multiple of `--update-weights-interval`, and the last step pushes), so a
point's snapshot and its stamped version are the same weights.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import structlog

from miles_aio.eval.dispatcher import EvalPointResult, EvalReport, eval_due, point_samples
from miles_aio.eval.snapshots import EvalSkip, Snapshot, SnapshotRetirer, SnapshotSource

__all__ = ["SnapshotEvalDispatcher", "SnapshotEvaluator"]

log = structlog.get_logger("miles_aio.eval")


class SnapshotEvaluator(Protocol):
    async def evaluate_snapshot(self, snapshot: Path, *, step: int, version: int) -> dict[str, float]: ...


@dataclass(slots=True)
class _Point:
    step: int
    snapshot: Snapshot | None = None  # None: not taken yet
    skip: str | None = None
    waited_s: float = 0.0


class SnapshotEvalDispatcher:
    def __init__(
        self,
        evaluator: SnapshotEvaluator,
        source: SnapshotSource,
        *,
        interval: int | None,
        final_step: int,
        before_train: bool = True,
        max_in_flight: int = 2,
        overflow_policy: Literal["backpressure", "skip"] = "backpressure",
        keep_snapshots: int = 2,
    ) -> None:
        self._evaluator = evaluator
        self._source = source
        self._interval = interval
        self._final_step = final_step
        self._before_train = before_train
        self._max_in_flight = max_in_flight
        self._overflow = overflow_policy
        self.retirer = SnapshotRetirer(keep_snapshots, source)
        self._tg: asyncio.TaskGroup | None = None  # the controller's, from dispatch()
        self._lock = asyncio.Lock()
        self._prepared: dict[int, _Point] = {}
        self._pending: list[asyncio.Task[None]] = []
        self._ready: list[EvalPointResult] = []
        self._skips: Counter[str] = Counter()
        self._steps_seen = 0
        self._last_point = -1  # eval step of the latest point prepared or dispatched
        self.results: list[dict[str, float]] = []
        """Every finished point's metrics, in completion order."""
        self.skipped: list[tuple[int, str]] = []
        """(eval step, reason) of every skipped point."""
        self.points = 0

    def due(self, steps_done: int) -> bool:
        return eval_due(
            steps_done, self._interval, final_step=self._final_step, before_train=self._before_train
        )

    @property
    def pending(self) -> int:
        """Points dispatched and not settled yet."""
        self._pending = [t for t in self._pending if not t.done()]
        return len(self._pending)

    async def wait_before_push(self, *, steps_done: int) -> float:
        """Take the snapshot of a due step (with backpressure); on the final step, await every point.

        Returns the seconds this blocked the controller (export, backpressure, final wait).
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self._steps_seen = max(self._steps_seen, steps_done)
        if steps_done >= self._final_step:
            while self.pending:
                await asyncio.wait(list(self._pending))
        if self.due(steps_done) and steps_done > self._last_point:
            self._last_point = steps_done
            self._prepared[steps_done] = await self._prepare(steps_done)
        return loop.time() - t0

    async def _prepare(self, steps_done: int) -> _Point:
        point = _Point(steps_done)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self.pending >= self._max_in_flight:
            if self._overflow == "skip":
                point.skip = "busy"
                return point
            while self.pending >= self._max_in_flight:  # backpressure: wait for the oldest pending point
                await asyncio.wait([self._pending[0]])
        point.waited_s = loop.time() - t0
        try:
            point.snapshot = await self._source.take(steps_done)
        except EvalSkip as e:
            point.skip = e.reason
        return point

    def dispatch(self, tg: asyncio.TaskGroup, *, steps_done: int, version: int) -> None:
        """Start the point of `steps_done` (its snapshot taken by `wait_before_push`, or by itself)."""
        self._steps_seen = max(self._steps_seen, steps_done)
        self._last_point = max(self._last_point, steps_done)
        point = self._prepared.pop(steps_done, None)
        if point is None:  # not prepared (the pre-train point): the task takes the snapshot
            point = _Point(steps_done, skip="busy" if self.pending >= self._max_in_flight else None)
        if point.skip is not None:
            self._skip(point.step, point.skip)
            return
        self._tg = tg
        self._pending.append(tg.create_task(self._run(point, version), name=f"eval-step-{steps_done}"))

    async def _run(self, point: _Point, version: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            if point.snapshot is None:
                point.snapshot = await self._source.take(point.step)
            snapshot = point.snapshot
            if not snapshot.path.is_dir():  # one stat: no thread needed
                raise EvalSkip("ckpt_missing")
            async with self._lock:
                t0 = loop.time()
                metrics = dict(
                    await self._evaluator.evaluate_snapshot(snapshot.path, step=point.step, version=version)
                )
                metrics.setdefault("eval/duration_seconds", loop.time() - t0)
                samples = point_samples(self._evaluator)  # under the lock: this point's
        except EvalSkip as e:
            self._skip(point.step, e.reason)
        except Exception as e:  # CancelledError is not an Exception: it propagates
            log.error("eval point crashed", step=point.step, error=repr(e), exc_info=True)
            self._skip(point.step, "crashed")
        else:
            metrics.update(
                {
                    "eval/step": float(point.step),
                    "eval/version": float(version),
                    "eval/lag_steps": float(self._steps_seen - point.step),
                    "eval/backpressure_wait_seconds": point.waited_s,
                }
            )
            if snapshot.exported:
                metrics["eval/export_time_seconds"] = snapshot.export_time_s
            self._ready.append(EvalPointResult(metrics, samples))
            self.results.append(metrics)
            self.points += 1
            log.info(
                "eval point",
                step=point.step,
                version=version,
                lag_steps=self._steps_seen - point.step,
                **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items() if "accuracy" in k},
            )
        # Retirement deletes through the trainer's rank 0, which may be busy training: in its own task
        # (the controller's group), so this point settles and frees its in-flight slot now.
        assert self._tg is not None
        self._tg.create_task(self._retire(point.snapshot), name=f"eval-retire-{point.step}")

    async def _retire(self, snapshot: Snapshot | None) -> None:
        try:
            await self.retirer.retire(snapshot)
        except Exception as e:  # a snapshot left on disk must not stop training; cancellation propagates
            log.warning("eval snapshot not retired", error=repr(e))

    def _skip(self, step: int, reason: str) -> None:
        log.warning("eval point skipped", step=step, reason=reason)
        self._skips[reason] += 1
        self.skipped.append((step, reason))

    def collect(self) -> EvalReport:
        """The points settled since the last call and the skip counts; each handed out once."""
        report = EvalReport(
            points=self._ready, skipped={f"eval/skipped_{r}": float(n) for r, n in self._skips.items()}
        )
        self._ready = []
        self._skips.clear()
        return report

"""`RunObserver`: what the controller's step loop reports, kept out of the controller.

Per step (`end_step`): the engine load the controller read during the step (`perf/engine/*`, from
`engine_load()`), the eval points finished since the last step
(each gets its own line in `<run-dir>/eval_points.jsonl`, its own eval-hook call with its samples, and
its own trace slice; the step record carries the newest point's metrics and the skip counters), the
logging hooks (`miles_aio.observability.hooks`), every metrics sink, the trace's step slice and
counters, and the step's log line. Per step, `begin_step` binds `step` and `version` as structlog
context variables, so every log line of the step loop carries them (`version` is rebound by
`version_pushed`).

Sinks: `<run-dir>/metrics.jsonl` (always, with files), the caller's sinks, wandb (`--use-wandb`).
The timeline tracer (`run_tracer`) is built first, since the engine client records into it; the observer
is built last, from the tracer, the buffer and the scheduler state it samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized

import structlog

from miles_aio.config import RunConfig
from miles_aio.eval.dispatcher import EvalReport
from miles_aio.metrics import JsonlSink, MetricsSink, brief
from miles_aio.observability.accounting import StepTimes
from miles_aio.observability.engine_load import engine_load_metrics
from miles_aio.observability.hooks import flat_args, resolve_log_hooks
from miles_aio.observability.registry import check_metrics
from miles_aio.observability.reward_watch import RewardWatch
from miles_aio.observability.trace import NullTracer, Tracer
from miles_aio.scheduler.policy import SchedulerState
from miles_aio.types import Group

__all__ = ["RunObserver", "run_tracer"]

log = structlog.get_logger("miles_aio.controller")


def run_tracer(cfg: RunConfig, *, write_files: bool = True) -> Tracer:
    """The run's timeline trace (`--trace`, written at the end), or a no-op one."""
    o = cfg.observability
    if write_files and o.trace:
        return Tracer(cfg.run_dir / o.trace, max_events=o.trace_max_events)
    return NullTracer()


class RunObserver:
    """Owns the run's sinks, tracer and hooks; the controller calls it at each step and push.

    `buffer` and `state` are what the counter tracks and `rollout/in_flight_groups` sample."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: object,
        *,
        tracer: Tracer,
        buffer: Sized,
        state: SchedulerState,
        sinks: Sequence[MetricsSink] = (),
        write_files: bool = True,
    ) -> None:
        self.engine = engine
        self.tracer = tracer
        self.jsonl = JsonlSink(cfg.run_dir / "metrics.jsonl") if write_files else None
        self.eval_points = JsonlSink(cfg.run_dir / "eval_points.jsonl") if write_files else None
        self.sinks: list[MetricsSink] = [self.jsonl] if self.jsonl is not None else []
        self.sinks.extend(sinks)
        if cfg.observability.use_wandb and write_files:
            from miles_aio.observability.wandb_sink import WandbSink

            self.sinks.append(WandbSink(cfg))
        self.hooks = resolve_log_hooks(cfg)
        self.args = flat_args(cfg)
        self.reward_watch = RewardWatch(reward_key=cfg.train.reward_key)
        self.version: int | None = None
        self._buffer, self._state = buffer, state
        self._eval_started: dict[int, float] = {}  # eval step → when its point was dispatched

    def sample_counters(self) -> None:
        """Counter tracks `buffer_depth` (groups) and `in_flight_samples` (limiter slots of the worker)."""
        if self.tracer.enabled:
            self.tracer.counter("buffer_depth", len(self._buffer))
            self.tracer.counter("in_flight_samples", self._state.slots_held)

    def begin_step(self, step: int, version: int | None) -> None:
        structlog.contextvars.bind_contextvars(step=step, version=version)

    def version_pushed(self, version: int) -> None:
        """A push finished: rebind the log context, sample the counters."""
        self.version = version
        structlog.contextvars.bind_contextvars(version=version)
        self.sample_counters()

    def eval_dispatched(self, steps_done: int) -> None:
        """An eval point started (its trace slice ends when its metrics arrive)."""
        self._eval_started[steps_done] = self.tracer.now()

    def _trace_eval(self, metrics: dict[str, float]) -> None:
        start = self._eval_started.pop(int(metrics.get("eval/step", -1)), None)
        if start is None:
            return
        duration = metrics.get("eval/duration_seconds")
        end = start + duration if duration is not None else None
        shown = {k: v for k, v in metrics.items() if "accuracy" in k or k in ("eval/step", "eval/version")}
        self.tracer.complete("eval point", track="eval", start=start, end=end, **shown)

    async def engine_load(self) -> dict[str, float]:
        """`perf/engine/*` now: one `/server_info` per engine in rotation (see `engine_load_metrics`). The
        controller asks while the step trains, so the round trip is not part of the step's own time. A
        metric never fails the run: a router whose `stats()` raises gives no load this step."""
        try:
            return await engine_load_metrics(self.engine)
        except Exception as e:  # CancelledError is not an Exception: a cancelled read still unwinds
            log.debug("engine load unavailable", error=repr(e))
            return {}

    async def end_step(
        self,
        step: int,
        groups: list[Group],
        metrics: dict[str, float],
        *,
        evals: EvalReport,
        times: StepTimes,
        start: float,
        train_start: float,
        engine_load: Mapping[str, float],
    ) -> dict[str, float]:
        """Finish the step's record (returned), call the hooks, log it to the sinks, trace it.
        `engine_load`: `engine_load()`'s answer for this step."""
        metrics["rollout/policy_version"] = float(self.version or 0)
        metrics["rollout/in_flight_groups"] = float(self._state.in_flight_groups)
        metrics.update(engine_load)
        eval_metrics = evals.step_metrics()
        metrics.update(eval_metrics)
        check_metrics(metrics)  # a warning, once per name, for a metric the registry lacks
        samples = [s for g in groups for s in g]
        self.reward_watch.observe(step, samples)  # one warning line per streak of constant-reward steps
        skip_rollout = await self.hooks.log_rollout(self.args, step, samples, metrics, times.wait_data_s)
        skip_eval = False
        for point in evals.points:
            if self.eval_points is not None:
                self.eval_points.log(int(point.metrics.get("eval/step", step)), point.metrics)
            skip_eval |= await self.hooks.log_eval(self.args, point.metrics, point.samples)
            self._trace_eval(point.metrics)
        default = {  # what the hooks took over goes to metrics.jsonl only
            k: v
            for k, v in metrics.items()
            if not (skip_eval and k in eval_metrics) and not (skip_rollout and k.startswith("rollout/"))
        }
        for sink in self.sinks:
            sink.log(step, metrics if sink is self.jsonl else default)
        tr = self.tracer
        if tr.enabled:
            tr.complete("wait data", track="trainer", start=start, end=train_start)
            tr.complete("train", track="trainer", start=train_start, end=train_start + times.train_s)
            tr.complete(
                f"step {step}", track="trainer", start=start, groups=len(groups), samples=len(samples)
            )
            self.sample_counters()
        log.info("step", **brief(metrics))
        return metrics

    def close(self) -> None:
        """Close every sink and write the trace (the end of a run, also a failed one)."""
        structlog.contextvars.unbind_contextvars("step", "version")
        try:
            for sink in self.sinks:
                sink.close()
            if self.eval_points is not None:
                self.eval_points.close()
        finally:
            self.tracer.close()

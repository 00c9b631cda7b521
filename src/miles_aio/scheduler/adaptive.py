"""Adaptive concurrency (`--async-max-concurrent-samples auto`): the in-flight bound follows engine load.

The DECISION is `decide_limit()`, a pure function of state (no awaits, no clock, no I/O), tested
exhaustively with hypothesis. Given the current limit and what was observed over the last interval:

* **congested** — the engines queue requests beyond a tolerance, or requests were retracted/aborted:
  shrink multiplicatively (the extra requests only wait in the engines' queues and age).
* **not binding** — admission was rarely blocked by the in-flight bound (the buffer, pacing or the
  trainer are the limit): hold; a larger bound would change nothing.
* **throughput fell** after the last increase by more than the tolerance (20%): step back one step.
* otherwise the engines keep up: grow (×`growth`, at least one group).

The result is always clamped to [--adaptive-concurrency-min, --adaptive-concurrency-max].

The LOOP (`AdaptiveConcurrency.run`) applies the decisions:
  consumes: engine load samples (`/server_info` via `engine_load_metrics`, or a fake's `load()`),
            the generated-token counter, the worker's capacity-blocked seconds, aborted-token counts
  produces: a new size for the rollout `Limiter` and the same value as the admission policy's
            in-flight bound (`AdmissionLimits.max_in_flight_samples`), so the two never disagree
  waits for: a timer (`interval_s`) or the end of the rollout worker task, whichever comes first
The controller builds it from the run config (`AdaptiveConcurrency.from_config`, `auto` only) and its
own components, starts it in its TaskGroup (task `adaptive-concurrency`), and it ends with the worker.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import structlog

from miles_aio.observability.engine_load import LoadReporting, engine_load_metrics

if TYPE_CHECKING:
    from miles_aio.config import RunConfig
    from miles_aio.observability.accounting import StepAccounting
    from miles_aio.rollout.limiter import Limiter
    from miles_aio.scheduler.policy import AdmissionLimits

__all__ = [
    "AdaptiveConcurrency",
    "AdaptiveMemory",
    "AdaptiveParams",
    "AdmissionBound",
    "EngineLoad",
    "Observation",
    "ReportsLoad",
    "decide_limit",
    "load_sampler",
]

log = structlog.get_logger("miles_aio.adaptive")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Engine load summed over the engines: requests decoding, requests waiting in their queues."""

    running: float
    queued: float


class AdmissionBound(Protocol):
    """What the loop reads and sets of admission (a `miles_aio.scheduler.worker.AdmissionGate`)."""

    @property
    def limits(self) -> AdmissionLimits: ...

    def blocked_seconds(self, now: float) -> dict[str, float]: ...

    def set_max_in_flight(self, samples: int) -> None: ...


@runtime_checkable
class ReportsLoad(Protocol):
    """An engine (e.g. a fake) that reports its load directly rather than over `/server_info`."""

    def load(self) -> EngineLoad: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class AdaptiveParams:
    lo: int  # --adaptive-concurrency-min
    hi: int  # --adaptive-concurrency-max
    group_size: int = 1  # the smallest step (admission is by whole groups)
    growth: float = 1.25  # multiplicative increase while the engines keep up
    shrink: float = 0.75  # multiplicative decrease on congestion
    queue_tolerance: float = 0.05  # queued requests tolerated, as a fraction of running ones
    binding_ratio: float = 0.5  # capacity-blocked fraction of the interval above which the bound binds
    throughput_tolerance: float = 0.2  # a relative drop below this is noise (requests end in bursts)

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"bounds must satisfy 1 <= lo <= hi, got [{self.lo}, {self.hi}]")
        if not (self.growth > 1 and 0 < self.shrink < 1):
            raise ValueError("growth must be > 1 and shrink in (0, 1)")

    def clamp(self, limit: int) -> int:
        return min(self.hi, max(self.lo, limit))


@dataclass(frozen=True, kw_only=True, slots=True)
class Observation:
    """What happened over one interval."""

    load: EngineLoad | None  # None: the engines do not report load
    capacity_blocked_ratio: float  # fraction of the interval admission waited on the in-flight bound
    throughput: float  # generated tokens / s over the interval
    retracted: int = 0  # requests retracted or aborted by the engines in the interval


@dataclass(frozen=True, slots=True)
class AdaptiveMemory:
    """What the decision remembers between intervals."""

    last_throughput: float | None = None  # throughput of the interval before the last change
    last_direction: int = 0  # +1 grew, -1 shrank, 0 held
    settled: bool = False  # congestion was seen once: grow additively from now on (no more slow start)


def congested(p: AdaptiveParams, obs: Observation) -> bool:
    if obs.retracted > 0:
        return True
    if obs.load is None:
        return False
    return obs.load.queued > p.queue_tolerance * max(1.0, obs.load.running)


def decide_limit(
    p: AdaptiveParams, limit: int, memory: AdaptiveMemory, obs: Observation
) -> tuple[int, AdaptiveMemory, str]:
    """(new limit, new memory, reason). Pure: the same inputs always give the same answer."""
    limit = p.clamp(limit)
    if congested(p, obs):
        # shrink to what the engines actually run (no deeper than × shrink): the rest only queued
        target = math.floor(limit * p.shrink)
        if obs.load is not None and obs.retracted == 0:
            target = max(target, math.floor(obs.load.running))
        new = p.clamp(min(limit - 1, target))
        return new, AdaptiveMemory(obs.throughput, -1 if new < limit else 0, True), "congested"
    if obs.capacity_blocked_ratio < p.binding_ratio:
        return limit, AdaptiveMemory(obs.throughput, 0, memory.settled), "not_binding"
    prev = memory.last_throughput
    if (
        memory.last_direction > 0
        and prev is not None
        and obs.throughput < prev * (1 - p.throughput_tolerance)
    ):
        new = p.clamp(limit - max(p.group_size, math.ceil(limit * 0.05)))  # undo one additive step
        return new, AdaptiveMemory(obs.throughput, -1 if new < limit else 0, True), "throughput_fell"
    # slow start (× growth) until the first congestion, then additive steps of >= 5% or a group
    step = math.ceil(limit * (p.growth - 1)) if not memory.settled else math.ceil(limit * 0.05)
    new = p.clamp(limit + max(p.group_size, step))
    direction = 1 if new > limit else 0
    return new, AdaptiveMemory(obs.throughput, direction, memory.settled), "grow" if new > limit else "at_max"


def apply_limit(limit: int, *, limiter: Limiter, gate: AdmissionBound) -> None:
    """Resize the limiter and the admission policy's in-flight bound together (the same value).

    A larger bound wakes the admission loop at once; a smaller one lets in-flight requests finish and
    admits nothing new until below it."""
    limiter.total_tokens = limit
    gate.set_max_in_flight(limit)


class AdaptiveConcurrency:
    """The loop applying `decide_limit` every `interval_s` (see the module docstring)."""

    def __init__(
        self,
        params: AdaptiveParams,
        *,
        limiter: Limiter,
        gate: AdmissionBound,
        generated_tokens: Callable[[], int],
        sample_load: Callable[[], Awaitable[EngineLoad | None]],
        retracted: Callable[[], int] = lambda: 0,
        interval_s: float = 5.0,
        initial: int | None = None,
    ) -> None:
        self.params = params
        self._limiter, self._gate = limiter, gate
        self._tokens, self._sample_load, self._retracted = generated_tokens, sample_load, retracted
        self.interval_s = interval_s
        self.limit = params.clamp(initial if initial is not None else gate.limits.max_in_flight_samples)
        self.memory = AdaptiveMemory()
        self.history: list[tuple[float, int, str]] = []  # (loop time, limit after, reason)

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        *,
        limiter: Limiter,
        gate: AdmissionBound,
        accounting: StepAccounting,
        generated_tokens: Callable[[], int],
        sample_load: Callable[[], Awaitable[EngineLoad | None]],
    ) -> AdaptiveConcurrency | None:
        """The run's loop with `--async-max-concurrent-samples auto`, else None: bounds from
        --adaptive-concurrency-min/max/interval-s, steps of whole groups, starting from the run's initial
        in-flight bound; aborted tokens (`accounting`) count as retracted requests."""
        s = cfg.scheduler
        if not s.adaptive:
            return None
        params = AdaptiveParams(
            lo=s.adaptive_concurrency_min,
            hi=s.adaptive_concurrency_max,
            group_size=cfg.rollout.n_samples_per_prompt,
        )
        return cls(
            params,
            limiter=limiter,
            gate=gate,
            generated_tokens=generated_tokens,
            sample_load=sample_load,
            retracted=lambda: accounting.wasted_tokens["aborted"],
            interval_s=s.adaptive_concurrency_interval_s,
            initial=cfg.max_in_flight_samples,
        )

    async def run(self, until: asyncio.Future[Any]) -> None:
        """Decide every interval until `until` (the worker task, owned by the caller's TaskGroup) is
        done; then return."""
        loop = asyncio.get_running_loop()
        apply_limit(self.limit, limiter=self._limiter, gate=self._gate)
        t, tokens, retracted = loop.time(), self._tokens(), self._retracted()
        blocked = self._gate.blocked_seconds(t).get("capacity", 0.0)
        self.history.append((t, self.limit, "start"))
        while True:
            finished, _ = await asyncio.wait([until], timeout=self.interval_s)
            if finished:
                return
            now = loop.time()
            load = await self._sample_load()
            now_tokens, now_retracted = self._tokens(), self._retracted()
            now_blocked = self._gate.blocked_seconds(now).get("capacity", 0.0)
            dt = max(now - t, 1e-9)
            obs = Observation(
                load=load,
                capacity_blocked_ratio=min(1.0, (now_blocked - blocked) / dt),
                throughput=(now_tokens - tokens) / dt,
                retracted=max(0, now_retracted - retracted),
            )
            t, tokens, retracted, blocked = now, now_tokens, now_retracted, now_blocked
            new, self.memory, reason = decide_limit(self.params, self.limit, self.memory, obs)
            if new != self.limit:
                log.info("adaptive concurrency", limit=new, was=self.limit, reason=reason)
                self.limit = new
                apply_limit(new, limiter=self._limiter, gate=self._gate)
            self.history.append((now, new, reason))


def load_sampler(engine: object) -> Callable[[], Awaitable[EngineLoad | None]]:
    """Read engine load from a fake's `load()`, or the engines' `/server_info` (an `EngineRouter`)."""

    async def sample() -> EngineLoad | None:
        if isinstance(engine, ReportsLoad):
            return engine.load()
        if isinstance(engine, LoadReporting):
            m = await engine_load_metrics(engine)
            if "perf/engine/num_running_reqs" in m:
                return EngineLoad(m["perf/engine/num_running_reqs"], m.get("perf/engine/queue_len", 0.0))
        return None

    return sample

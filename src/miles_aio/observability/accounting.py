"""Bubble accounting: per-step `perf/*` metrics from the controller's clocks and counters.

Everything here is a difference of cumulative counters between two step boundaries, divided by the
step's wall time, so the ratios of a step add up to what happened in that step:

  perf/trainer_idle_ratio    the driver waiting for data (the drain, and the prefetched drain before a push)
  perf/rollout_blocked_ratio the admission loop blocked by a full buffer, pacing or a pause — not by
                             the in-flight bound, which means the engines are busy (that is no bubble)
  perf/rollout_blocked_ratio/<reason>, perf/weight_sync_seconds, perf/eval_stall_seconds,
  perf/generated_tokens_per_s, perf/trained_tokens_per_s, perf/wasted_tokens[/<cause>]

The step's phases are timed by a `StepClock` (`with clock.phase("train"): ...`), which gives `StepTimes`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from miles_aio.types import Sample

__all__ = ["BLOCKING_REASONS", "Phase", "StepAccounting", "StepClock", "StepTimes"]

BLOCKING_REASONS = ("buffer_full", "pacing", "paused")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimes:
    """Seconds spent in each phase of one driver step."""

    step_s: float
    wait_data_s: float  # waiting for this step's batch, plus the prefetched drain before a push
    train_s: float
    weight_sync_s: float
    eval_s: float = 0.0


Phase = Literal["wait_data", "train", "weight_sync", "eval"]


class StepClock:
    """Times one driver step on `now` (the loop clock), from its construction: `with clock.phase(p):`
    adds the block's seconds to phase `p` (a phase may run several times; its seconds add up).

    `since`: where the step's wall time (`step_s`) starts, if earlier than the construction: the moment
    the previous step's times were read. What happens between the two (writing the previous step's
    record) then counts in this step, so the steps' times add up to the run's wall time."""

    def __init__(self, now: Callable[[], float], *, since: float | None = None) -> None:
        self._now = now
        self.start = now()
        self.since = self.start if since is None else min(since, self.start)
        self.began: dict[Phase, float] = {}  # when each phase first began
        self._seconds: dict[Phase, float] = {"wait_data": 0.0, "train": 0.0, "weight_sync": 0.0, "eval": 0.0}

    @contextmanager
    def phase(self, name: Phase) -> Iterator[None]:
        t0 = self._now()
        self.began.setdefault(name, t0)
        try:
            yield
        finally:
            self._seconds[name] += self._now() - t0

    def times(self) -> StepTimes:
        """The step so far: its wall time until now (from `since`) and the seconds of each phase."""
        s = self._seconds
        return StepTimes(
            step_s=self._now() - self.since,
            wait_data_s=s["wait_data"],
            train_s=s["train"],
            weight_sync_s=s["weight_sync"],
            eval_s=s["eval"],
        )


class StepAccounting:
    def __init__(
        self,
        *,
        blocked_seconds: Callable[[float], dict[str, float]],
        generated_tokens: Callable[[], int],
    ) -> None:
        self._blocked_seconds = blocked_seconds
        self._generated_tokens = generated_tokens
        self._last_blocked: dict[str, float] = {}
        self._last_generated = 0
        self.wasted_tokens: Counter[str] = Counter()
        self._last_wasted: Counter[str] = Counter()

    def add_wasted(self, cause: str, samples: Sequence[Sample]) -> None:
        """Tokens generated for samples that will never be trained on (aborted, stale, filtered, failed)."""
        self.wasted_tokens[cause] += sum(s.response_length for s in samples)

    def step_metrics(self, times: StepTimes, *, now: float, trained_tokens: int) -> dict[str, float]:
        step = max(times.step_s, 1e-9)
        blocked = self._blocked_seconds(now)
        delta = {r: blocked.get(r, 0.0) - self._last_blocked.get(r, 0.0) for r in blocked}
        self._last_blocked = blocked
        generated = self._generated_tokens()
        new_tokens, self._last_generated = generated - self._last_generated, generated
        wasted = self.wasted_tokens - self._last_wasted
        self._last_wasted = Counter(self.wasted_tokens)
        metrics = {
            "perf/step_time_s": times.step_s,
            "perf/trainer_idle_ratio": min(1.0, times.wait_data_s / step),
            "perf/rollout_blocked_ratio": min(1.0, sum(delta.get(r, 0.0) for r in BLOCKING_REASONS) / step),
            "perf/weight_sync_seconds": times.weight_sync_s,
            "perf/eval_stall_seconds": times.eval_s,
            "perf/train_seconds": times.train_s,
            "perf/generated_tokens_per_s": new_tokens / step,
            "perf/trained_tokens_per_s": trained_tokens / max(times.train_s, 1e-9),
            "perf/wasted_tokens": float(sum(wasted.values())),
        }
        for reason in (*BLOCKING_REASONS, "capacity"):
            metrics[f"perf/rollout_blocked_ratio/{reason}"] = min(1.0, delta.get(reason, 0.0) / step)
        for cause in ("aborted", "stale", "filtered", "failed"):
            metrics[f"perf/wasted_tokens/{cause}"] = float(wasted.get(cause, 0))
        return metrics

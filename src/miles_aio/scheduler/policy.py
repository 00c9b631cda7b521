"""Submission decisions as plain functions of state: no awaits, no clock, no I/O.

The rollout worker (`miles_aio.scheduler.worker`) reports every event to a `SchedulerState` and asks
`decide_admission()` whether it may submit the next prompt group. Three independent limits apply:

* **In-flight bound** (`--async-max-concurrent-samples`): slots are counted in samples. A group takes
  `n` slots on admission. With granularity `sample` each finished sample frees its slot; with `group`
  the slots are freed together when the whole group task returns (`on_group_generated`): after its
  slowest sample and after a `--group-rm` reward, so groups cannot pile up inside a slow group reward.
* **Blocked put**: while a finished group waits for room in a full buffer, nothing is admitted (as in
  miles, where the worker loop itself blocks on `put`). Slots are still freed, so the pool drains.
* **Admission pacing** (`--max-admission-staleness K`): a group is admitted only if it cannot be more
  than K versions old when it is consumed. See `pacing_allows()` for the argument.

A `pause` (shared-engine eval, shutdown) stops admission too. Each decision carries its reason, which
the observability layer turns into `perf/rollout_blocked_ratio` by cause.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "AdmissionLimits",
    "Blocked",
    "DrainSchedule",
    "SchedulerState",
    "decide_admission",
    "pacing_allows",
]


class Blocked(enum.StrEnum):
    """Why admission is refused right now (None from `decide_admission` means: admit)."""

    CAPACITY = "capacity"  # the in-flight bound is reached
    BUFFER_FULL = "buffer_full"  # a finished group is waiting for room in the buffer
    PACING = "pacing"  # the group could end up older than --max-admission-staleness when consumed
    PAUSED = "paused"  # admission paused (eval on shared engines, shutdown)


@dataclass(frozen=True, kw_only=True, slots=True)
class DrainSchedule:
    """Which policy version the driver holds when it drains each step's batch.

    The driver pushes weights after step t when (t+1) % interval == 0, and drains step s+1 while step s
    trains (one-step prefetch), finishing that drain before the push. So the drain for step s sees the
    pushes after steps start_step .. s-2:  V(s) = start_version + #{t in [start_step, s-2] : (t+1) % I == 0}.
    """

    batch_groups: int  # B, groups consumed per step
    update_interval: int = 1  # I
    start_step: int = 0
    start_version: int = 1

    def drain_version(self, step: int) -> int:
        """V(step): the current policy version while the batch for `step` is drained."""
        if step < self.start_step:
            raise ValueError(f"step {step} precedes the start step {self.start_step}")
        last = step - 2  # the last step whose push precedes this drain
        i = self.update_interval
        pushes = max(0, (last + 1) // i - self.start_step // i) if last >= self.start_step else 0
        return self.start_version + pushes

    def groups_consumable_by(self, version: int) -> int:
        """J(v): how many groups (counted from start_step) are consumed while the version is <= v.

        V is non-decreasing and grows by one every I steps, so the steps with V(s) <= v form a prefix
        [start_step, s_max]; find s_max by bisection.
        """
        if version < self.start_version:
            return 0
        lo, hi = (
            self.start_step,
            self.start_step + (version - self.start_version + 2) * self.update_interval + 2,
        )
        while lo < hi:  # smallest s with V(s) > version
            mid = (lo + hi) // 2
            if self.drain_version(mid) > version:
                hi = mid
            else:
                lo = mid + 1
        return (lo - self.start_step) * self.batch_groups


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionLimits:
    """The static limits (from the run config)."""

    max_in_flight_samples: int
    group_size: int
    granularity: Literal["sample", "group"] = "sample"
    max_admission_staleness: int | None = None
    schedule: DrainSchedule

    def __post_init__(self) -> None:
        if self.max_in_flight_samples < self.group_size:
            raise ValueError("the in-flight bound must hold at least one whole group")


@dataclass(slots=True)
class _Flight:
    remaining: int  # samples still generating
    slots: int  # slots still held by this group


@dataclass(slots=True)
class SchedulerState:
    """Everything the admission decision depends on. Mutated only through the `on_*` methods.

    A group moves: admitted → (samples finish) → generated → put done/blocked → consumed or discarded.
    "Unconsumed" groups (admitted, not yet consumed or discarded) are what pacing counts.
    """

    version: int | None = None
    paused: bool = False
    slots_held: int = 0
    blocked_puts: int = 0
    consumed: int = 0  # groups consumed since the schedule's start_step
    _flights: dict[int, _Flight] = field(default_factory=dict)
    _admit_version: dict[int, int] = field(default_factory=dict)  # unconsumed group → admission version
    _admit_versions: Counter[int] = field(default_factory=Counter)

    @property
    def in_flight_groups(self) -> int:
        return len(self._flights)

    @property
    def unconsumed(self) -> int:
        return len(self._admit_version)

    def oldest_unconsumed_version(self) -> int | None:
        return min(self._admit_versions) if self._admit_versions else None

    # -- events ---------------------------------------------------------------------------------------
    def on_admit(self, group_id: int, group_size: int) -> None:
        if group_id in self._admit_version:
            raise ValueError(f"group {group_id} admitted twice")
        self._flights[group_id] = _Flight(remaining=group_size, slots=group_size)
        self.slots_held += group_size
        v = self.version if self.version is not None else 0
        self._admit_version[group_id] = v
        self._admit_versions[v] += 1

    def on_restored(self, group_id: int, version: int) -> None:
        """A finished group restored from a checkpoint (buffered or drained): unconsumed, holds no slot."""
        if group_id in self._admit_version:
            raise ValueError(f"group {group_id} restored twice")
        self._admit_version[group_id] = version
        self._admit_versions[version] += 1

    def on_sample_done(self, group_id: int, granularity: Literal["sample", "group"]) -> None:
        """One sample of the group finished (any status, or its task was cancelled)."""
        flight = self._flights[group_id]
        if flight.remaining <= 0:
            raise ValueError(f"group {group_id}: more samples finished than were admitted")
        flight.remaining -= 1
        freed = 1 if granularity == "sample" else 0  # group: all at once, in on_group_generated
        flight.slots -= freed
        self.slots_held -= freed

    def on_group_generated(self, group_id: int) -> None:
        """The group task returned (its samples and any `--group-rm` reward are done, or it failed as a
        whole): release what it still holds — under `group` granularity, all its slots."""
        flight = self._flights.pop(group_id)
        self.slots_held -= flight.slots

    def on_put_blocked(self) -> None:
        self.blocked_puts += 1

    def on_put_unblocked(self) -> None:
        if self.blocked_puts <= 0:
            raise ValueError("put unblocked more often than it blocked")
        self.blocked_puts -= 1

    def on_consumed(self, group_id: int) -> None:
        self._forget(group_id)
        self.consumed += 1

    def on_discarded(self, group_id: int) -> None:
        """The group was filtered, dropped or recycled: it will not be consumed (under this admission)."""
        self._forget(group_id)

    def on_version(self, version: int) -> None:
        if self.version is not None and version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} → {version}")
        self.version = version

    def _forget(self, group_id: int) -> None:
        v = self._admit_version.pop(group_id)
        self._admit_versions[v] -= 1
        if not self._admit_versions[v]:
            del self._admit_versions[v]


def pacing_allows(limits: AdmissionLimits, state: SchedulerState) -> bool:
    """May one more group be admitted without any group ending up older than K when consumed?

    Let L = consumed + unconsumed groups (after admitting this one) and m the oldest admission version
    among unconsumed groups (including this one, admitted at the current version). Invariant kept at
    every admission: L <= J(m + K), where J(v) counts the consumption slots drained at versions <= v.

    Why it bounds staleness: take a group g admitted at version a, consumed as the j-th group. After
    the last admission before g's consumption, L never grew, and at that admission g was unconsumed,
    so m <= a. Thus j < L <= J(a + K): g is consumed in a drain whose version is at most a + K, and its
    tokens are no older than a. This holds for any finish order — a straggler throttles admission
    instead of silently aging (AReaL's capacity formula uses the current version for m, which bounds
    the count but not a straggler's age).
    """
    k = limits.max_admission_staleness
    if k is None:
        return True
    current = state.version if state.version is not None else 0
    oldest = state.oldest_unconsumed_version()
    m = current if oldest is None else min(oldest, current)
    live_after = state.consumed + state.unconsumed + 1
    return live_after <= limits.schedule.groups_consumable_by(m + k)


def decide_admission(limits: AdmissionLimits, state: SchedulerState) -> Blocked | None:
    """None if the next group may be admitted now, else the first reason it may not (capacity first)."""
    # Capacity first: when the in-flight bound binds, the engines are saturated and any other limit
    # costs nothing yet; the reason returned is what bubble accounting charges the wait to.
    if state.slots_held + limits.group_size > limits.max_in_flight_samples:
        return Blocked.CAPACITY
    if state.paused:
        return Blocked.PAUSED
    if state.blocked_puts > 0:
        return Blocked.BUFFER_FULL
    if not pacing_allows(limits, state):
        return Blocked.PACING
    return None

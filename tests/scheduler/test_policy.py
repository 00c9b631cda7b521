"""The admission policy, exhaustively: hypothesis drives random event orders through the pure core."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio.scheduler.policy import (
    AdmissionLimits,
    Blocked,
    DrainSchedule,
    SchedulerState,
    decide_admission,
)

pytestmark = pytest.mark.pure


def limits(
    *, bound: int = 8, n: int = 2, gran: str = "sample", k: int | None = None, b: int = 2, i: int = 1
) -> AdmissionLimits:
    return AdmissionLimits(
        max_in_flight_samples=bound,
        group_size=n,
        granularity=gran,  # type: ignore[arg-type]
        max_admission_staleness=k,
        schedule=DrainSchedule(batch_groups=b, update_interval=i),
    )


# -- the drain schedule against a direct simulation of the driver -----------------------------------------
def simulated_drain_versions(
    steps: int, interval: int, start_step: int = 0, start_version: int = 1
) -> list[int]:
    """Version held while each step's batch is drained, by replaying the driver loop literally."""
    version, out = start_version, {start_step: start_version}  # the first drain is not prefetched
    for step in range(start_step, start_step + steps):
        out[step + 1] = version  # drain of step+1 runs while `step` trains, before its push
        if (step + 1) % interval == 0:
            version += 1
    return [out[s] for s in range(start_step, start_step + steps)]


@given(interval=st.integers(1, 5), start_step=st.integers(0, 12), start_version=st.integers(1, 9))
def test_drain_version_matches_the_driver_loop(interval: int, start_step: int, start_version: int) -> None:
    sched = DrainSchedule(
        batch_groups=3, update_interval=interval, start_step=start_step, start_version=start_version
    )
    expected = simulated_drain_versions(200, interval, start_step, start_version)
    assert [sched.drain_version(s) for s in range(start_step, start_step + 200)] == expected
    for v in range(start_version - 1, start_version + 8):
        assert sched.groups_consumable_by(v) == 3 * sum(x <= v for x in expected)


# -- the in-flight bound ----------------------------------------------------------------------------------
@settings(max_examples=300)
@given(
    gran=st.sampled_from(["sample", "group"]),
    n=st.integers(1, 4),
    extra=st.integers(0, 9),
    choices=st.lists(st.integers(0, 1000), min_size=1, max_size=200),
)
def test_in_flight_samples_never_exceed_the_bound(gran: str, n: int, extra: int, choices: list[int]) -> None:
    lim = limits(bound=n + extra, n=n, gran=gran)
    state = SchedulerState(version=1)
    running: dict[int, int] = {}  # group → samples still generating
    next_gid = 0
    for c in choices:
        if c % 3 == 0 and decide_admission(lim, state) is None:
            state.on_admit(next_gid, n)
            running[next_gid] = n
            next_gid += 1
        elif running:
            gid = sorted(running)[c % len(running)]
            state.on_sample_done(gid, lim.granularity)
            running[gid] -= 1
            if running[gid] == 0:
                del running[gid]
                state.on_group_generated(gid)
        unfinished = sum(running.values())
        # what each granularity promises: sample frees per sample, group frees when all are done
        assert state.slots_held == (unfinished if gran == "sample" else n * len(running))
        assert state.slots_held <= lim.max_in_flight_samples
        if decide_admission(lim, state) is Blocked.CAPACITY:
            assert state.slots_held + n > lim.max_in_flight_samples


def test_blocked_put_and_pause_stop_admission() -> None:
    lim = limits()
    state = SchedulerState(version=1)
    state.on_put_blocked()
    assert decide_admission(lim, state) is Blocked.BUFFER_FULL
    state.on_put_unblocked()
    state.paused = True
    assert decide_admission(lim, state) is Blocked.PAUSED
    state.paused = False
    assert decide_admission(lim, state) is None
    with pytest.raises(ValueError, match="unblocked"):
        state.on_put_unblocked()


def test_versions_only_go_up() -> None:
    state = SchedulerState()
    state.on_version(3)
    with pytest.raises(ValueError, match="backwards"):
        state.on_version(2)


# -- admission pacing: a discrete-event model of the whole pipeline --------------------------------------
@dataclass
class Pipeline:
    """Worker, FIFO buffer and the driver with one-step prefetch, advanced one event at a time."""

    lim: AdmissionLimits
    steps: int
    state: SchedulerState = field(default_factory=lambda: SchedulerState(version=1))
    version: int = 1
    in_flight: dict[int, int] = field(default_factory=dict)  # gid → admission version
    buffer: deque[tuple[int, int]] = field(default_factory=deque)
    drain_step: int = 0  # the step whose batch is being drained
    drained: int = 0  # groups taken for drain_step
    train_step: int | None = None  # step being trained, or None
    trained: int = 0
    next_gid: int = 0
    max_seen_staleness: int = 0
    straggler_every: int = 0  # groups with gid % straggler_every == 0 finish only when nothing else can

    @property
    def b(self) -> int:
        return self.lim.schedule.batch_groups

    def events(self) -> list[str]:
        ev = []
        if decide_admission(self.lim, self.state) is None:
            ev.append("admit")
        if self.in_flight:
            ev += ["finish", "abort"]
        # drain_step only advances when training of the previous step starts: the one-step prefetch
        if self.buffer and self.drain_step < self.steps and self.drained < self.b:
            ev.append("get")
        if self.train_step is not None and (not self.push_due() or self.drain_done()):
            ev.append("train_done")  # a due push first waits for the prefetched drain to finish
        return ev

    def push_due(self) -> bool:
        return self.train_step is not None and (self.train_step + 1) % self.lim.schedule.update_interval == 0

    def drain_done(self) -> bool:
        return self.drained == self.b or self.drain_step == self.steps

    def apply(self, ev: str, pick: int) -> None:
        if ev == "admit":
            gid, self.next_gid = self.next_gid, self.next_gid + 1
            self.state.on_admit(gid, 1)
            self.in_flight[gid] = self.version
        elif ev in ("finish", "abort"):
            order = sorted(self.in_flight)
            if self.straggler_every:
                fast = [g for g in order if g % self.straggler_every]
                order = fast or order  # an adversary: stragglers return only when nothing else is left
            # half the time finish the newest group: last-in-first-out also leaves stragglers behind
            gid = order[-1] if pick % 2 else order[(pick // 2) % len(order)]
            admitted_at = self.in_flight.pop(gid)
            self.state.on_sample_done(gid, "sample")
            self.state.on_group_generated(gid)
            if ev == "abort":
                self.state.on_discarded(gid)  # aborted at put → unused handler
            else:
                self.buffer.append((gid, admitted_at))
        elif ev == "get":
            gid, admitted_at = self.buffer.popleft()
            self.state.on_consumed(gid)
            self.max_seen_staleness = max(self.max_seen_staleness, self.version - admitted_at)
            self.drained += 1
        elif ev == "train_done":
            assert self.train_step is not None
            step, self.train_step = self.train_step, None
            self.trained += 1
            if (step + 1) % self.lim.schedule.update_interval == 0:
                self.version += 1
                self.state.on_version(self.version)
        self.maybe_start_training()

    def maybe_start_training(self) -> None:
        # the driver starts training step s once its batch is complete and step s-1 (and its push) is done
        if self.train_step is None and self.drained == self.b and self.drain_step == self.trained:
            self.train_step = self.drain_step
            self.drain_step += 1
            self.drained = 0


@settings(max_examples=400, deadline=None)
@given(
    k=st.integers(0, 3),
    b=st.integers(1, 4),
    interval=st.integers(1, 3),
    bound=st.integers(1, 12),
    straggler_every=st.sampled_from([0, 2, 3, 5, 8, 10**6]),
    priority=st.sampled_from(
        [None, "get train_done admit finish abort", "admit get train_done finish abort"]
    ),
    rnd=st.randoms(use_true_random=False),
    n_events=st.integers(1, 400),
)
def test_admission_pacing_never_lets_a_consumed_group_exceed_k(
    k: int,
    b: int,
    interval: int,
    bound: int,
    straggler_every: int,
    priority: str | None,
    rnd: random.Random,
    n_events: int,
) -> None:
    # an unbounded run: ending it early would hide the age of stragglers that are never consumed
    p = Pipeline(
        lim=limits(bound=bound, n=1, k=k, b=b, i=interval), steps=10**6, straggler_every=straggler_every
    )
    for _ in range(n_events):
        ev = p.events()
        if not ev:
            break
        c = rnd.randrange(10_000)
        if priority is None or c % 5 == 0:  # a random event, or the drawn priority order with some noise
            p.apply(ev[c % len(ev)], c // 7)
        else:
            p.apply(next(e for e in priority.split() if e in ev), c // 7)
        assert p.max_seen_staleness <= k
    # Liveness, and the stragglers' fate: keep running (more steps if needed) until every admitted group
    # has been consumed or discarded — a straggler that is never consumed would hide its staleness.
    target = p.trained + 4
    for _ in range(20_000):
        if p.trained >= target and not p.in_flight and not p.buffer:
            break
        ev = p.events()
        assert ev, "pacing deadlocked the pipeline"
        p.apply(next(e for e in ["get", "train_done", "finish", "admit"] if e in ev), 0)
        assert p.max_seen_staleness <= k
    assert p.trained >= target and not p.in_flight


def test_current_version_pacing_lets_a_straggler_age_beyond_k() -> None:
    """AReaL's formula (pace on the current version) bounds how many groups are live, not a straggler's
    age. This scenario is the counter-example; the same scenario under our rule stays within K."""

    def run(k: int) -> int:
        p = Pipeline(lim=limits(bound=64, n=1, k=k, b=2), steps=10**6, straggler_every=10**6)
        while p.trained < 6:  # group 0 is the straggler: it returns only when nothing else is in flight
            ev = p.events()
            p.apply(next(e for e in ["get", "train_done", "admit", "finish"] if e in ev), 1)
        while p.in_flight or p.buffer:
            ev = p.events()
            p.apply(next(e for e in ["get", "train_done", "finish", "admit"] if e in ev), 0)
        return p.max_seen_staleness

    assert run(1) <= 1
    # the same pipeline with pacing on the current version only (monkeypatched min → current)
    import miles_aio.scheduler.policy as policy

    original = policy.SchedulerState.oldest_unconsumed_version
    policy.SchedulerState.oldest_unconsumed_version = lambda self: None  # type: ignore[method-assign]
    try:
        assert run(1) > 1
    finally:
        policy.SchedulerState.oldest_unconsumed_version = original  # type: ignore[method-assign]

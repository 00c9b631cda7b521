"""`RolloutWorker`: the persistent producer loop — admit prompt groups, run them, put them in the buffer.

_admission loop (one, `run()`):
  consumes: prompt groups from the DataSource (recycled first)
  produces: one group task per admitted group, in the worker's TaskGroup
  waits for: the `AdmissionGate` to open (`decide_admission()` returns None: in-flight bound, blocked
             put, pacing, pause); lets the event loop run after every `ADMIT_BURST_SAMPLES` admitted
  unblocked by: a sample or group finishing, a put completing, the driver consuming or discarding a
                group, a new policy version, a new in-flight bound, resume()
_group task (one per admitted group):
  consumes: its prompt group; produces: one `BufferItem` into the DataBuffer
  waits for: the rollout pool (engine calls), then `buffer.put()` (blocks while the buffer is full)

`AdmissionGate` is the admission decision's inputs (limits, `SchedulerState`) with the notifier that
wakes the admission loop on every change and the clock of the time it spent blocked. It is built before
the buffer and the worker, so that what tells admission of changes — the buffer's group fates
(discards), the driver (consumption, versions), adaptive concurrency (the bound), the step accounting
(blocked seconds) — needs no worker.

The worker never returns on its own. It stops when its task is cancelled (shutdown) or when a group
task raises (user code, engine failure under a loud policy): the TaskGroup cancels the other groups
and the error propagates to the controller, which fails the next drain with it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from typing import NoReturn

import structlog

from miles_aio._aio import LoopShare
from miles_aio._notify import Notifier
from miles_aio.buffer.base import DataBuffer
from miles_aio.data.source import DataSource
from miles_aio.ledger import Ledger
from miles_aio.rollout.pool import RolloutPool
from miles_aio.scheduler.policy import AdmissionLimits, SchedulerState, decide_admission
from miles_aio.types import BufferItem, Group, group_oldest_version

__all__ = ["AdmissionGate", "RolloutWorker"]

log = structlog.get_logger("miles_aio.worker")

ADMIT_BURST_SAMPLES = 8
"""The admission loop admits at most this many samples' groups before it lets the event loop run: each
admitted sample's first engine call runs in the next pass, so the burst sizes that pass (64: passes of
5-10 ms at 50,000 in flight, `benchmarks.soak`; 16 → 8 with `METRICS_CHUNK_SAMPLES` 64 → 16: the lag
case's p99 from 10-11 to 4.4-4.6 ms, `benchmarks.controller`)."""


class AdmissionGate:
    """Where the admission loop waits: the limits, the scheduler state, a notifier woken by every change
    of either, and the seconds spent blocked, by reason (see the module docstring)."""

    def __init__(self, limits: AdmissionLimits, state: SchedulerState | None = None) -> None:
        self.limits = limits
        self.state = state if state is not None else SchedulerState()
        self._changed = Notifier()
        # time the admission loop spent blocked, by reason (capacity, buffer_full, pacing, paused)
        self._blocked_s: defaultdict[str, float] = defaultdict(float)
        self._blocked_since: tuple[str, float] | None = None

    async def wait_open(self) -> None:
        """Return once `decide_admission()` admits the next group; each wait is charged to its reason."""
        loop = asyncio.get_running_loop()
        while (reason := decide_admission(self.limits, self.state)) is not None:
            self._blocked_since = (reason.value, loop.time())
            try:
                await self._changed.wait()
            finally:
                self._blocked_s[reason.value] += loop.time() - self._blocked_since[1]
                self._blocked_since = None

    def notify(self) -> None:
        """The state changed (the worker's own events): let the admission loop decide again."""
        self._changed.notify()

    def blocked_seconds(self, now: float) -> dict[str, float]:
        """Cumulative seconds the admission loop has been blocked, by reason, including a wait in progress."""
        totals = dict(self._blocked_s)
        if self._blocked_since is not None:
            reason, since = self._blocked_since
            totals[reason] = totals.get(reason, 0.0) + now - since
        return totals

    # -- what the driver, the buffer's fates and adaptive concurrency tell admission -----------------
    def on_consumed(self, gid: int) -> None:
        self.state.on_consumed(gid)
        self._changed.notify()

    def on_discarded(self, gid: int) -> None:
        self.state.on_discarded(gid)
        self._changed.notify()

    def publish_version(self, version: int) -> None:
        self.state.on_version(version)
        self._changed.notify()

    def pause(self) -> None:
        """Stop admitting new groups (in-flight ones continue)."""
        self.state.paused = True

    def resume(self) -> None:
        self.state.paused = False
        self._changed.notify()

    def set_max_in_flight(self, samples: int) -> None:
        """A new in-flight bound (adaptive concurrency); a larger one admits at once."""
        self.limits = replace(self.limits, max_in_flight_samples=max(samples, self.limits.group_size))
        self._changed.notify()

    def restore(self, finished: Iterable[tuple[int, int]], *, start_step: int, version: int) -> None:
        """Resume from a checkpoint: pace from its step and version; its finished (buffered or drained)
        groups, given as (group id, oldest version), count as unconsumed."""
        schedule = replace(self.limits.schedule, start_step=start_step, start_version=version)
        self.limits = replace(self.limits, schedule=schedule)
        for gid, oldest in finished:
            self.state.on_restored(gid, oldest)
        self._changed.notify()


class RolloutWorker:
    def __init__(
        self,
        *,
        gate: AdmissionGate,
        source: DataSource,
        pool: RolloutPool,
        buffer: DataBuffer,
        ledger: Ledger,
    ) -> None:
        self.gate = gate
        self._source = source
        self._pool = pool
        self._buffer = buffer
        self._ledger = ledger
        # admitted, not yet handed to the buffer; their pristine prompt groups are rebuilt from the data
        # source on demand (deterministic from the group id) rather than deep-copied on every admission
        self._pending: set[int] = set()
        self._resubmit: list[Group] = []  # in flight at a checkpoint: admitted again first on resume
        self.finished_groups = 0

    @property
    def state(self) -> SchedulerState:
        return self.gate.state

    # -- the loops ------------------------------------------------------------------------------------
    async def run(self) -> NoReturn:
        state, share = self.gate.state, LoopShare(ADMIT_BURST_SAMPLES)
        async with asyncio.TaskGroup() as tg:
            while True:
                await self.gate.wait_open()
                resubmitted = bool(self._resubmit)
                prompt_group = self._resubmit.pop(0) if resubmitted else self._source.next_group()
                gid = prompt_group[0].group_index
                state.on_admit(gid, len(prompt_group))
                self._ledger.record("resubmitted" if resubmitted else "admitted", gid)
                self._pending.add(gid)
                tg.create_task(self._run_group(gid, prompt_group), name=f"rollout-group-{gid}")
                # An open gate does not suspend: at 50,000 in flight, a drained step frees slots for
                # thousands of groups, and admitting them all in one callback stalled every rollout
                # for 0.2-0.45 s. Let the loop run between bursts (the groups admitted so far start).
                if share.due(len(prompt_group)):
                    await asyncio.sleep(0)

    async def _run_group(self, gid: int, prompt_group: Group) -> None:
        state = self.gate.state
        try:
            group = await self._pool.run_group(prompt_group, on_sample_done=lambda: self._sample_done(gid))
        finally:
            state.on_group_generated(gid)
            self.gate.notify()
        item = BufferItem(group=group, group_index=gid, make_prompt_group=self._source.make_group)
        state.on_put_blocked()
        try:
            await self._buffer.put(item)
        finally:
            state.on_put_unblocked()
            self.gate.notify()
        self._pending.discard(gid)
        self.finished_groups += 1

    def _sample_done(self, gid: int) -> None:
        granularity = self.gate.limits.granularity
        self.gate.state.on_sample_done(gid, granularity)
        # Under `group` granularity a sample frees no slot and changes nothing `decide_admission` reads
        # (the group's slots go at once, in on_group_generated): waking the admission loop would only
        # make it decide "blocked" again, once per sample.
        if granularity == "sample":
            self.gate.notify()

    # -- checkpoints ----------------------------------------------------------------------------------
    def restore(
        self, finished: list[BufferItem], in_flight: list[Group], *, start_step: int, version: int
    ) -> None:
        """Resume from a checkpoint: pace from its step and version, count its finished (buffered or
        drained) groups as unconsumed, and admit the groups it had in flight again before any other."""
        self._resubmit.extend(in_flight)
        self.gate.restore(
            ((it.group_index, group_oldest_version(it.group) or version) for it in finished),
            start_step=start_step,
            version=version,
        )

    def pending_prompt_groups(self) -> list[Group]:
        """Prompt groups admitted but not yet in the buffer (for checkpoints: re-submitted on resume)."""
        return [self._source.make_group(gid) for gid in sorted(self._pending)]

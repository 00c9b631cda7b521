"""The producer side on its own, on virtual time: the `AdmissionGate` (built before the buffer and the
worker) and the `RolloutWorker` admitting, running and putting groups (the `Notifier` both wait on:
tests/core/test_notify.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from miles_aio.buffer import BufferItem, DataBufferContext, DefaultDataBuffer
from miles_aio.ledger import Ledger, read_ledger
from miles_aio.rollout.pool import RolloutPool
from miles_aio.scheduler.policy import AdmissionLimits, Blocked, DrainSchedule, decide_admission
from miles_aio.scheduler.worker import ADMIT_BURST_SAMPLES, AdmissionGate, RolloutWorker
from miles_aio.types import Group, Status
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]


# ---- AdmissionGate --------------------------------------------------------------------------------------
def limits(max_in_flight: int = 4, group_size: int = 2, **kw: Any) -> AdmissionLimits:
    return AdmissionLimits(
        max_in_flight_samples=max_in_flight,
        group_size=group_size,
        schedule=DrainSchedule(batch_groups=2),
        **kw,
    )


def test_the_gate_opens_when_capacity_frees_and_charges_the_wait_to_its_reason(vrun: Any) -> None:
    gate = AdmissionGate(limits(max_in_flight=2))
    gate.publish_version(1)

    async def main() -> tuple[float, dict[str, float], dict[str, float]]:
        loop = asyncio.get_running_loop()
        gate.state.on_admit(7, 2)  # the bound (2 samples) is full
        waiting = loop.create_task(gate.wait_open(), name="admission")

        async def free() -> None:
            await asyncio.sleep(2.0)
            gate.state.on_sample_done(7, "sample")
            gate.notify()  # one slot: still not a whole group
            await asyncio.sleep(1.0)
            during.update(gate.blocked_seconds(loop.time()))  # a wait in progress counts
            gate.state.on_sample_done(7, "sample")
            gate.notify()

        during: dict[str, float] = {}
        await asyncio.gather(waiting, free())
        return loop.time(), during, gate.blocked_seconds(loop.time())

    t, during, after = vrun(main())
    assert t == pytest.approx(3.0)
    assert during == {"capacity": pytest.approx(3.0)}
    assert after == {"capacity": pytest.approx(3.0)}


def test_a_larger_bound_a_discard_and_a_consumption_each_wake_admission(vrun: Any) -> None:
    gate = AdmissionGate(limits(max_in_flight=2, max_admission_staleness=0))
    gate.publish_version(1)
    gids = iter(range(100))

    def admit_until_blocked() -> Blocked:
        """Admit (and finish generating) groups until admission is refused; the reason."""
        while (reason := decide_admission(gate.limits, gate.state)) is None:
            gid = next(gids)
            gate.state.on_admit(gid, 2)
            gate.state.on_group_generated(gid)
        return reason

    async def opens_after(change: Any) -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        waiting = loop.create_task(gate.wait_open(), name="admission")
        await asyncio.sleep(1.0)
        assert not waiting.done()
        change()
        await waiting
        return loop.time() - t0

    async def main() -> list[float]:
        waits = []
        gate.state.on_admit(next(gids), 2)  # in flight: the bound of 2 samples binds
        waits.append(await opens_after(lambda: gate.set_max_in_flight(4)))
        assert gate.limits.max_in_flight_samples == 4
        gate.state.on_group_generated(0)
        # pacing, K = 0: the 4 groups of steps 0 and 1 may be admitted at version 1, no more
        assert admit_until_blocked() == Blocked.PACING and gate.state.unconsumed == 4
        waits.append(await opens_after(lambda: gate.on_discarded(3)))  # one fewer unconsumed
        assert admit_until_blocked() == Blocked.PACING
        gate.publish_version(2)  # the unconsumed groups of version 1 still pace admission
        assert decide_admission(gate.limits, gate.state) == Blocked.PACING
        for gid in (0, 1, 2):
            gate.on_consumed(gid)
        waits.append(await opens_after(lambda: gate.on_consumed(4)))  # the last of version 1
        return waits

    assert vrun(main()) == [pytest.approx(1.0)] * 3
    assert set(gate.blocked_seconds(0.0)) == {"capacity", "pacing"}


def test_a_paused_gate_opens_on_resume_and_a_bound_never_drops_below_a_group(vrun: Any) -> None:
    gate = AdmissionGate(limits(max_in_flight=4))

    async def main() -> dict[str, float]:
        gate.pause()
        waiting = asyncio.get_running_loop().create_task(gate.wait_open(), name="admission")
        await asyncio.sleep(2.0)
        gate.resume()
        await waiting
        return gate.blocked_seconds(asyncio.get_running_loop().time())

    assert vrun(main()) == {"paused": pytest.approx(2.0)}
    gate.set_max_in_flight(1)
    assert gate.limits.max_in_flight_samples == 2  # one whole group at least


def test_restore_paces_from_the_checkpoint_and_counts_finished_groups_unconsumed() -> None:
    gate = AdmissionGate(limits())
    gate.restore([(5, 3), (6, 2)], start_step=4, version=3)
    assert (gate.limits.schedule.start_step, gate.limits.schedule.start_version) == (4, 3)
    assert gate.state.unconsumed == 2 and gate.state.oldest_unconsumed_version() == 2
    gate.on_consumed(6)
    assert gate.state.unconsumed == 1 and gate.state.consumed == 1


# ---- RolloutWorker --------------------------------------------------------------------------------------
class StubPool:
    """Runs a group in `latency_s` per sample, one sample after the other; `fail` raises for a group."""

    def __init__(self, latency_s: float = 1.0, fail: int | None = None) -> None:
        self.latency_s, self.fail = latency_s, fail
        self.started: list[int] = []

    async def run_group(self, prompt_group: Group, *, on_sample_done: Any) -> Group:
        gid = prompt_group[0].group_index
        self.started.append(gid)
        for s in prompt_group:
            await asyncio.sleep(self.latency_s)
            on_sample_done()
            s.status = Status.COMPLETED
        if gid == self.fail:
            raise LookupError(f"user code failed on group {gid}")
        return prompt_group


def producer(
    tmp_path: Path,
    pool: StubPool,
    *,
    capacity_factor: float = 2.0,
    max_in_flight: int = 4,
    ledger_path: Path | None = None,
) -> tuple[AdmissionGate, RolloutWorker, DefaultDataBuffer, Ledger]:
    """A worker wired as the controller wires it: gate first, then the buffer (whose callbacks tell the
    gate of discards), then the worker."""
    cfg = make_config(tmp_path, rollout_batch_size=2, async_data_buffer_capacity_factor=capacity_factor)
    source = make_source(n=2)
    ledger = Ledger(ledger_path, dataset_size=source.dataset_size)
    gate = AdmissionGate(limits(max_in_flight=max_in_flight))
    gate.publish_version(1)
    buffer = DefaultDataBuffer(
        DataBufferContext(
            config=cfg,
            on_unused=lambda item, why: gate.on_discarded(item.group_index),
            on_filtered=lambda item, why: gate.on_discarded(item.group_index),
        )
    )
    worker = RolloutWorker(
        gate=gate, source=source, pool=cast("RolloutPool", pool), buffer=buffer, ledger=ledger
    )
    return gate, worker, buffer, ledger


def test_the_worker_fills_the_bound_then_the_buffer_and_then_waits(vrun: Any, tmp_path: Path) -> None:
    pool = StubPool(latency_s=1.0)
    gate, worker, buffer, ledger = producer(tmp_path, pool, capacity_factor=2.0, max_in_flight=4)

    async def main() -> tuple[list[int], int, list[int]]:
        task = asyncio.get_running_loop().create_task(worker.run(), name="rollout-worker")
        await asyncio.sleep(0.5)
        early = (
            list(pool.started),
            gate.state.slots_held,
            [g[0].group_index for g in worker.pending_prompt_groups()],
        )
        await asyncio.sleep(30.0)
        assert not task.done()  # the worker never returns on its own
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return early

    started, slots, pending = vrun(main())
    assert len(started) == 2 and slots == 4  # two groups of two samples: the in-flight bound
    assert pending == sorted(started)  # admitted, not yet in the buffer
    # a full buffer (4 groups) blocks the next put, and a blocked put admits nothing more
    assert len(buffer) == 4 and worker.finished_groups == 4
    assert gate.blocked_seconds(0.0).get("buffer_full", 0.0) > 0
    assert gate.state.blocked_puts == 0 and gate.state.slots_held == 0  # cancelled: all let go
    assert ledger.counts["admitted"] == len(pool.started) < 10


def test_an_open_gate_lets_the_loop_run_between_bursts_of_admissions(vrun: Any, tmp_path: Path) -> None:
    """A drained step can open the gate for thousands of groups at once: the admission loop lets the
    event loop run after every `ADMIT_BURST_SAMPLES` samples, not only when the gate closes."""
    pool = StubPool(latency_s=100.0)
    gate, worker, _, ledger = producer(tmp_path, pool, max_in_flight=2000)

    async def main() -> list[int]:
        bursts, last = [], 0
        task = asyncio.get_running_loop().create_task(worker.run(), name="rollout-worker")
        while ledger.counts["admitted"] < 1000:  # the bound: 1000 groups of two samples
            await asyncio.sleep(0)
            bursts.append(ledger.counts["admitted"] - last)
            last = ledger.counts["admitted"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return bursts

    bursts = vrun(main())
    assert sum(bursts) == 1000 and gate.state.slots_held == 0
    assert max(bursts) == ADMIT_BURST_SAMPLES // 2  # groups of two samples


def test_consuming_from_the_buffer_lets_the_worker_admit_again(vrun: Any, tmp_path: Path) -> None:
    pool = StubPool(latency_s=1.0)
    gate, worker, buffer, ledger = producer(tmp_path, pool, capacity_factor=1.0, max_in_flight=2)

    async def main() -> list[int]:
        got = []
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(worker.run(), name="rollout-worker")
            for _ in range(6):  # three times the buffer's capacity
                item: BufferItem = await buffer.get(current_version=1)
                gate.on_consumed(item.group_index)
                got.append(item.group_index)
            task.cancel()
        return got

    got = vrun(main())
    assert len(set(got)) == 6 and gate.state.consumed == 6
    assert got == pool.started[:6]  # one group in flight at a time: consumed in admission order
    assert ledger.counts["admitted"] >= 6


def test_a_group_that_raises_stops_the_worker_with_that_error(vrun: Any, tmp_path: Path) -> None:
    order = make_source(n=2)
    order.next_group()
    second = order.next_group()[0].group_index
    pool = StubPool(latency_s=1.0, fail=second)
    _, worker, buffer, _ = producer(tmp_path, pool)

    with pytest.raises(ExceptionGroup) as e:
        vrun(worker.run())
    assert e.group_contains(LookupError, match=f"user code failed on group {second}")
    assert len(buffer) == worker.finished_groups < len(pool.started)  # the failed group never put


def test_restore_admits_the_checkpointed_groups_again_first(vrun: Any, tmp_path: Path) -> None:
    pool = StubPool(latency_s=1.0)
    gate, worker, _, ledger = producer(tmp_path, pool, max_in_flight=2)
    in_flight = [make_source(n=2).make_group(g) for g in (111, 112)]  # epoch 2: never drawn fresh here
    ledger.resume(2, {111, 112})
    worker.restore([], in_flight, start_step=3, version=2)
    assert gate.limits.schedule.start_step == 3

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(worker.run(), name="rollout-worker")
        await asyncio.sleep(10.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    vrun(main())
    assert pool.started[:2] == [111, 112] and len(pool.started) > 2
    assert ledger.counts["resubmitted"] == 2


def test_the_ledger_records_each_admission_in_order_and_keeps_it_open_until_settled(
    vrun: Any, tmp_path: Path
) -> None:
    pool = StubPool(latency_s=1.0)
    path = tmp_path / "ledger.jsonl"
    gate, worker, buffer, ledger = producer(
        tmp_path, pool, capacity_factor=1.0, max_in_flight=2, ledger_path=path
    )

    async def main() -> list[int]:
        trained = []
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(worker.run(), name="rollout-worker")
            for step in range(3):
                item: BufferItem = await buffer.get(current_version=1)
                gate.on_consumed(item.group_index)
                ledger.record("trained", item.group_index, step=step)  # as the controller settles it
                trained.append(item.group_index)
            task.cancel()
        return trained

    trained = vrun(main())
    ledger.close()
    events = read_ledger(path)
    admitted = [e["group_id"] for e in events if e["fate"] == "admitted"]
    assert admitted == pool.started  # one event per admission, in admission order
    assert [e["group_id"] for e in events if e["fate"] == "trained"] == trained
    assert ledger.open_groups() == set(admitted) - set(trained)  # admitted, not yet settled: still open
    assert ledger.counts["admitted"] == len(admitted) and ledger.counts["trained"] == 3

"""The adaptive-concurrency loop on virtual time: timer-driven, resizes limiter and admission together."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from miles_aio.rollout.limiter import Limiter
from miles_aio.scheduler.adaptive import AdaptiveConcurrency, AdaptiveParams, EngineLoad, load_sampler
from miles_aio.scheduler.policy import AdmissionLimits, DrainSchedule

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(20)]


class StubWorker:
    """What the loop reads from the rollout worker: its limits and capacity-blocked seconds."""

    def __init__(self) -> None:
        self.limits = AdmissionLimits(
            max_in_flight_samples=16, group_size=4, schedule=DrainSchedule(batch_groups=4)
        )

    def blocked_seconds(self, now: float) -> dict[str, float]:
        return {"capacity": now}  # always blocked by the bound: it binds

    def set_max_in_flight(self, samples: int) -> None:
        self.limits = replace(self.limits, max_in_flight_samples=max(samples, self.limits.group_size))


def test_loop_grows_then_shrinks_on_queueing_and_keeps_bounds_consistent(vrun: Any) -> None:
    limiter, worker = Limiter(1000), StubWorker()
    cap = 64  # a toy engine running at most 64; the rest queue
    tokens = 0

    async def load() -> EngineLoad:
        return EngineLoad(running=min(limiter.total_tokens, cap), queued=max(0, limiter.total_tokens - cap))

    loop_ = AdaptiveConcurrency(
        AdaptiveParams(lo=8, hi=512, group_size=4),
        limiter=limiter,
        gate=worker,
        generated_tokens=lambda: tokens,
        sample_load=load,
        interval_s=2.0,
        initial=16,
    )

    async def main() -> float:
        nonlocal tokens
        done = asyncio.Event()
        t0 = asyncio.get_running_loop().time()
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(loop_.run(tg.create_task(done.wait())))
            for _ in range(60):  # steady token production, 1 s apart
                await asyncio.sleep(1.0)
                tokens += 100
                assert limiter.total_tokens == worker.limits.max_in_flight_samples
            done.set()
        assert task.done()
        return asyncio.get_running_loop().time() - t0

    elapsed = vrun(main())
    assert elapsed == pytest.approx(60.0, abs=0.5)  # the loop ended with `until`, not later
    decisions = loop_.history[1:]
    assert len(decisions) == 29 or len(decisions) == 30  # one per 2 s timer tick: no busy polling
    limits = [lim for _, lim, _ in decisions]
    assert max(limits) > cap and "congested" in {r for _, _, r in decisions}
    assert all(8 <= x <= 512 for x in limits)
    assert all(55 <= x <= 72 for x in limits[-8:]), limits  # settled at the engine's batch size


def test_load_sampler_reads_a_fake_engines_load_or_nothing(vrun: Any) -> None:
    class Fake:
        def load(self) -> EngineLoad:
            return EngineLoad(3, 1)

    assert vrun(load_sampler(Fake())()) == EngineLoad(3, 1)
    assert vrun(load_sampler(object())()) is None

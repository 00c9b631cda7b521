from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles_aio.rollout.limiter import Limiter

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(20)]


def test_limiter_bounds_concurrency_and_serves_fifo(vrun: Any) -> None:
    lim = Limiter(2)
    running, peak, order = 0, 0, []

    async def job(i: int) -> None:
        nonlocal running, peak
        async with lim:
            order.append(i)
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(1)
            running -= 1

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(6):
                tg.create_task(job(i))
            await asyncio.sleep(0.5)
            assert lim.statistics().borrowed == 2 and lim.statistics().waiting == 4

    vrun(main())
    assert peak == 2 and order == list(range(6))


def test_resize_wakes_waiters_and_cancelled_waiters_leak_nothing(vrun: Any) -> None:
    lim = Limiter(1)

    async def main() -> None:
        await lim.acquire()
        waiter = asyncio.create_task(lim.acquire())
        other = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        lim.total_tokens = 2
        await asyncio.wait_for(other, 1)
        assert lim.statistics().borrowed == 2
        lim.release()
        lim.release()
        assert lim.statistics() == type(lim.statistics())(2, 0, 0)
        with pytest.raises(RuntimeError):
            lim.release()

    vrun(main())


def test_higher_priority_waiters_are_served_first(vrun: Any) -> None:
    lim = Limiter(1)
    order: list[str] = []

    async def job(name: str, priority: int) -> None:
        async with lim.slot(priority):
            order.append(name)
            await asyncio.sleep(1)

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(job("first", 0))
            await asyncio.sleep(0.1)
            for i in range(3):
                tg.create_task(job(f"rollout{i}", 0))
            await asyncio.sleep(0.1)
            tg.create_task(job("eval", 1))

    vrun(main())
    assert order == ["first", "eval", "rollout0", "rollout1", "rollout2"]

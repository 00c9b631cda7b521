from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.integers(0, 1)),
        st.tuples(st.just("cancel"), st.integers(0, 20)),
        st.tuples(st.just("release"), st.integers(0, 20)),
        st.tuples(st.just("resize"), st.integers(1, 4)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_no_waiter_is_left_behind_a_free_slot(ops: list[tuple[str, int]]) -> None:
    """Whatever mix of acquires (two priority classes), cancellations, releases and resizes: once the
    loop settles, every task that got a slot holds exactly one, and nobody waits while a slot is free
    (the fast paths that skip the queues when none is waiting must not lose a wake-up)."""

    async def main() -> None:
        lim = Limiter(2)
        waiting: list[asyncio.Task[None]] = []
        holders = 0
        for op, arg in ops:
            if op == "acquire":
                waiting.append(asyncio.create_task(lim.acquire(arg)))
            elif op == "cancel" and waiting:
                waiting.pop(arg % len(waiting)).cancel()
            elif op == "release" and holders:
                lim.release()
                holders -= 1
            elif op == "resize":
                lim.total_tokens = arg
            for _ in range(3):
                await asyncio.sleep(0)
            done = [t for t in waiting if t.done()]
            waiting = [t for t in waiting if not t.done()]
            holders += sum(not t.cancelled() for t in done)
            stats = lim.statistics()
            assert stats.borrowed == holders
            assert stats.waiting == len(waiting)
            assert not waiting or holders >= lim.total_tokens
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(main())

"""`Notifier` on virtual time: FIFO wakeups, `wait_until` re-checks its predicate and loses no wakeup, a
notify wakes only those waiting then, and a waiter that is cancelled or fails is forgotten."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles_aio._notify import Notifier

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(10)]


def test_notify_wakes_every_waiter_in_the_order_they_began_waiting(vrun: Any) -> None:
    async def main() -> tuple[list[int], int]:
        n, woke = Notifier(), []

        async def waiter(i: int) -> None:
            await n.wait()
            woke.append(i)

        async with asyncio.TaskGroup() as tg:
            for i in (3, 1, 4, 0, 2):  # started in this order, whatever their futures' addresses
                tg.create_task(waiter(i), name=f"waiter-{i}")
            await asyncio.sleep(0)
            assert n.waiting == 5
            n.notify()
        return woke, n.waiting

    assert vrun(main()) == ([3, 1, 4, 0, 2], 0)


def test_wait_until_rechecks_its_predicate_after_each_notify_and_loses_no_wakeup(vrun: Any) -> None:
    async def main() -> float:
        n, state = Notifier(), {"x": 0}

        async def bump() -> None:
            for _ in range(3):
                await asyncio.sleep(1.0)
                state["x"] += 1
                n.notify()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(bump(), name="bump")
            await n.wait_until(lambda: state["x"] >= 3)
        await n.wait_until(lambda: True)  # already true: returns without waiting
        return asyncio.get_running_loop().time()

    assert vrun(main()) == pytest.approx(3.0)


def test_a_notify_before_anyone_waits_is_not_remembered(vrun: Any) -> None:
    async def main() -> float:
        n = Notifier()
        n.notify()  # nobody waits: nothing to wake, nothing kept for later
        loop = asyncio.get_running_loop()
        loop.call_later(2.0, n.notify)
        await n.wait()  # returns at the next notify, not at once
        return loop.time()

    assert vrun(main()) == pytest.approx(2.0)


def test_a_cancelled_waiter_is_forgotten_and_the_others_still_wake(vrun: Any) -> None:
    async def main() -> tuple[int, bool]:
        n = Notifier()
        loop = asyncio.get_running_loop()
        cancelled = loop.create_task(n.wait(), name="cancelled-waiter")
        kept = loop.create_task(n.wait(), name="kept-waiter")
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        left = n.waiting
        n.notify()
        await kept
        return left, kept.done() and n.waiting == 0

    assert vrun(main()) == (1, True)


def test_a_predicate_that_raises_propagates_and_leaves_no_waiter(vrun: Any) -> None:
    async def main() -> int:
        n, calls = Notifier(), []

        def predicate() -> bool:
            calls.append(1)
            if len(calls) == 2:
                raise LookupError("state is gone")
            return False

        loop = asyncio.get_running_loop()
        loop.call_later(1.0, n.notify)
        with pytest.raises(LookupError, match="state is gone"):
            await n.wait_until(predicate)  # checked now (False), then after the notify: raises
        return n.waiting

    assert vrun(main()) == 0

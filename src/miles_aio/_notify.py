"""`Notifier`: wait until a predicate over plain state holds; state changes call `notify()`.

asyncio.Condition needs its lock held to notify, which a synchronous callback (a sample finishing, a
`close()`) cannot do. Here `notify()` is a plain method, and since asyncio runs one callback at a
time, checking the predicate and registering the waiter happen with nothing in between: no wakeup is
lost. Waiters wake in the order they started waiting (FIFO), so a run on virtual time is reproducible:
the order does not depend on where the waiters' futures happen to sit in memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import final

__all__ = ["Notifier"]


@final
class Notifier:
    def __init__(self) -> None:
        self._waiters: dict[asyncio.Future[None], None] = {}  # insertion-ordered: wakeups are FIFO

    @property
    def waiting(self) -> int:
        """How many tasks wait for the next `notify()` now (a woken or cancelled one no longer counts)."""
        return len(self._waiters)

    def notify(self) -> None:
        """Wake every current waiter, oldest first, so it re-checks its predicate."""
        if not self._waiters:  # the common case on the hot path (a sample finished, nobody waits)
            return
        waiters, self._waiters = self._waiters, {}
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self) -> None:
        """Return at the next `notify()`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[fut] = None
        try:
            await fut
        finally:
            self._waiters.pop(fut, None)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` is true (checked now and after every notify)."""
        while not predicate():
            await self.wait()

"""`Notifier`: wait until a predicate over plain state holds; state changes call `notify()`.

asyncio.Condition needs its lock held to notify, which a synchronous callback (a sample finishing, a
`close()`) cannot do. Here `notify()` is a plain method, and since asyncio runs one callback at a
time, checking the predicate and registering the waiter happen with nothing in between: no wakeup is
lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import final

__all__ = ["Notifier"]


@final
class Notifier:
    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        """Wake every current waiter so it re-checks its predicate."""
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def wait(self) -> None:
        """Return at the next `notify()`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` is true (checked now and after every notify)."""
        while not predicate():
            await self.wait()

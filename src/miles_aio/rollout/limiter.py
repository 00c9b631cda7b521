"""A resizable capacity limiter with borrower statistics (the one limiter of the rollout pool).

asyncio.Semaphore cannot be resized and does not say who holds what; the pool needs both: the size
is `--sglang-server-concurrency` × engines, which adaptive concurrency (`--async-max-concurrent-samples
auto`, `scheduler.adaptive.apply_limit`) resizes at run time, and observability reports how many slots
are borrowed and how many coroutines wait.
Waiters are served by priority class (higher first: eval requests before rollout ones), FIFO within a
class; a cancelled waiter never leaks a slot.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from types import TracebackType
from typing import final

__all__ = ["Limiter", "LimiterStats"]


@dataclass(frozen=True, slots=True)
class LimiterStats:
    total_tokens: int
    borrowed: int
    waiting: int


@final
class Limiter:
    """`async with limiter:` holds one of `total_tokens` slots for the body's duration."""

    def __init__(self, total_tokens: int) -> None:
        if total_tokens < 1:
            raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
        self._total = total_tokens
        self._borrowed = 0
        self._waiters: dict[int, collections.deque[asyncio.Future[None]]] = {}
        self._queued = 0  # futures in `_waiters` (some may be done): 0 lets acquire/release skip the queues

    @property
    def total_tokens(self) -> int:
        return self._total

    @total_tokens.setter
    def total_tokens(self, value: int) -> None:
        """Resize. Growing wakes waiters; shrinking lets borrowers finish and blocks new ones."""
        if value < 1:
            raise ValueError(f"total_tokens must be >= 1, got {value}")
        self._total = value
        self._wake()

    def statistics(self) -> LimiterStats:
        waiting = sum(not w.done() for q in self._waiters.values() for w in q)
        return LimiterStats(self._total, self._borrowed, waiting)

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot; waits behind every waiter of the same or a higher priority."""
        if self._borrowed < self._total and not self._queued:
            self._borrowed += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiters.setdefault(priority, collections.deque())
        queue.append(fut)
        self._queued += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slot was handed to us just as we were cancelled: pass it on, then re-raise.
                self.release()
            raise
        finally:
            if fut in queue:
                queue.remove(fut)
                self._queued -= 1

    def release(self) -> None:
        if self._borrowed <= 0:
            raise RuntimeError("release() without a matching acquire()")
        self._borrowed -= 1
        self._wake()

    def _wake(self) -> None:
        if not self._queued:  # nobody waits (the common case: one call per request)
            return
        for priority in sorted(self._waiters, reverse=True):
            queue = self._waiters[priority]
            while queue and self._borrowed < self._total:
                fut = queue.popleft()
                self._queued -= 1
                if not fut.done():
                    self._borrowed += 1
                    fut.set_result(None)

    def slot(self, priority: int) -> _Slot:
        """`async with limiter.slot(priority):` — a slot of a given priority class."""
        return _Slot(self, priority)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@final
class _Slot:
    def __init__(self, limiter: Limiter, priority: int) -> None:
        self._limiter = limiter
        self._priority = priority

    async def __aenter__(self) -> None:
        await self._limiter.acquire(self._priority)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._limiter.release()

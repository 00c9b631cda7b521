"""A resizable capacity limiter with borrower statistics (the one limiter of the rollout pool).

asyncio.Semaphore cannot be resized and does not say who holds what; the pool needs both: the size
is `--sglang-server-concurrency` × engines (adaptive concurrency will resize it at run time), and
observability reports how many slots are borrowed and how many coroutines wait.
Waiters are served in FIFO order; a cancelled waiter never leaks a slot.
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
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

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
        return LimiterStats(self._total, self._borrowed, sum(not w.done() for w in self._waiters))

    async def acquire(self) -> None:
        if self._borrowed < self._total and not self._waiters:
            self._borrowed += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slot was handed to us just as we were cancelled: pass it on, then re-raise.
                self.release()
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self) -> None:
        if self._borrowed <= 0:
            raise RuntimeError("release() without a matching acquire()")
        self._borrowed -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._borrowed < self._total:
            fut = self._waiters.popleft()
            if not fut.done():
                self._borrowed += 1
                fut.set_result(None)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

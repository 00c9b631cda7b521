"""Shared test helpers: run coroutines on virtual time (looptime) with a wall-clock and virtual deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import looptime
import pytest

T = TypeVar("T")


def run_virtual(coro: Coroutine[Any, Any, T], *, virtual_timeout_s: float = 10_000.0) -> T:
    """Run `coro` on an event loop whose clock only advances when every task is waiting.

    Sleeps cost no wall time, so latency-driven fakes run in milliseconds and deterministically.
    `virtual_timeout_s` bounds the virtual time, pytest-timeout bounds the wall time.
    """

    async def bounded() -> T:
        async with asyncio.timeout(virtual_timeout_s):
            return await coro

    loop = looptime.new_event_loop(start=0.0)
    try:
        return loop.run_until_complete(bounded())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@pytest.fixture
def vrun() -> Callable[..., Any]:
    return run_virtual

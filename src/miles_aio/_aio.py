"""Small asyncio building blocks shared by the process launchers and actors."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["finish_even_if_cancelled"]


async def finish_even_if_cancelled(coro: Coroutine[Any, Any, None]) -> None:
    """Await `coro` to its end even if the caller is cancelled meanwhile, then re-raise the cancellation.

    For cleanup that must not be abandoned half-way (taking child processes down). The cleanup runs as
    its own task, owned by a TaskGroup right here and shielded from our cancellation; the body waits for
    it, so it never outlives the caller.
    """
    cancelled = False
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(coro, name="cleanup")
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True  # keep waiting; re-raised once the cleanup is done
    if cancelled:
        raise asyncio.CancelledError

"""Small asyncio building blocks shared by the process launchers, actors and the embedded engine."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

import structlog

__all__ = ["LoopShare", "event_loop_factory", "finish_even_if_cancelled"]

_T = TypeVar("_T")
_log = structlog.get_logger(__name__)


class LoopShare:
    """Counts work done in one callback and says when to let the event loop run:
    `if share.due(len(group)): await asyncio.sleep(0)` after each piece (a loop over 50,000 samples in
    one callback stalls every rollout). A plain method, not a coroutine: the pieces are on hot paths."""

    __slots__ = ("_every", "_since")

    def __init__(self, every: int) -> None:
        self._every = every
        self._since = 0

    def due(self, units: int) -> bool:
        """`units` more done; True (and the count restarts) once `every` have been since the last yield."""
        self._since += units
        if self._since < self._every:
            return False
        self._since = 0
        return True


async def finish_even_if_cancelled(coro: Coroutine[Any, Any, _T]) -> _T:
    """Await `coro` to its end even if the caller is cancelled meanwhile (however often), then re-raise
    the cancellation; otherwise return its result or raise its exception.

    For work that must not be abandoned half-way: taking child processes down, or a collective running
    in a thread that cannot be stopped. `coro` runs as its own task, owned by a TaskGroup right here and
    shielded from our cancellation; the body waits for it, so it never outlives the caller. If the
    caller was cancelled and `coro` failed too, its error is logged (the cancellation wins).
    """

    async def settle() -> tuple[bool, Any]:
        try:
            return True, await coro
        except Exception as exc:  # kept as the outcome, not as a TaskGroup failure
            return False, exc

    cancelled = False
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(settle(), name="finish-even-if-cancelled")
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True  # keep waiting; re-raised once the work is done
    ok, value = task.result()
    if cancelled:
        if not ok:
            _log.warning("work_finished_after_cancellation_failed", error=f"{type(value).__name__}: {value}")
        raise asyncio.CancelledError
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def event_loop_factory(name: Literal["asyncio", "uvloop"]) -> Callable[[], asyncio.AbstractEventLoop]:
    """What starts the controller's event loop for --event-loop `name` (`asyncio.Runner(loop_factory=)`)."""
    if name == "uvloop":
        # optional (an extra, never a dependency; `config.check_event_loop_installed`): imported by name
        factory: Callable[[], asyncio.AbstractEventLoop] = importlib.import_module("uvloop").new_event_loop
        return factory
    return asyncio.new_event_loop

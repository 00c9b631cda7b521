"""The `DataBuffer` contract. Subclass it and pass `--custom-async-data-buffer-path pkg.mod:Class`.

    rollout worker ──put(item)──►  DataBuffer  ──get(current_version=v, **context)──► driver drain
                                     │
                    ctx.on_unused(item, reason)   ctx.on_filtered(item, reason)

A buffer owns every group-level decision: it may store, reorder, filter or reject. It must give each
item it receives exactly one outcome — returned by `get()`, passed to `ctx.on_unused()` (aborted,
stale: recycled or dropped per `--async-unused-samples-handler`), or passed to `ctx.on_filtered()`
(dynamic-filter rejects: dropped, never recycled) — or hold it in `state_dict()`. The runtime uses
those calls for the ledger and for admission pacing, so an item silently forgotten leaks a slot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_aio.config import RunConfig
from miles_aio.types import BufferItem, Group

__all__ = ["DataBuffer", "DataBufferContext", "FilterDecision"]


@dataclass(frozen=True, slots=True)
class FilterDecision:
    keep: bool
    reason: str = "filtered"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataBufferContext:
    """What the runtime gives a buffer at construction."""

    config: RunConfig
    on_unused: Callable[[BufferItem, str], None]
    """An aborted or stale group: recycled (`retry`) or dropped (`drop`). reason: "aborted", "stale", ..."""
    on_filtered: Callable[[BufferItem, str], None]
    """A group rejected by the dynamic filter: dropped and counted, never recycled."""
    dynamic_filter: Callable[[Group], FilterDecision] | None = None
    """The user's `--dynamic-sampling-filter-path`, normalised; None when not configured."""


class DataBuffer(ABC):
    """Awaitable store of finished prompt groups. All methods run on the controller's event loop."""

    def __init__(self, ctx: DataBufferContext) -> None:
        self.ctx = ctx

    @abstractmethod
    async def put(self, item: BufferItem) -> None:
        """Called once per finished group by the rollout worker: store it or reject it.

        May block (a full buffer); while it does, the worker admits no new group.
        Raises `BufferClosed` after `close()`.
        """

    @abstractmethod
    async def get(self, *, current_version: int | None = None, **context: Any) -> BufferItem:
        """Called by the driver, once per group of a batch: blocks until a group is ready.

        The driver passes what it knows as keywords: today `current_version`, the policy version it
        holds (None before the first push). Later versions may pass more keys, so accept and ignore the
        ones you do not know (`**context`, as here and in `DefaultDataBuffer`; a `def get(self, **kwargs)`
        works too), as miles' `get(self, **context)` does. Raises `BufferClosed` after `close()`.

        Must be cancellation-safe: the driver cancels a waiting `get()` every `--stall-warning-s` (to
        log the stall, then calls again) and on a stop request. Take the group off the buffer only
        after the last `await`, as `DefaultDataBuffer` does, so a cancelled call never loses one.
        """

    @abstractmethod
    def get_metrics(self) -> dict[str, float]:
        """Window counters since the previous call (then reset), plus gauges such as queue size.

        Called once per step, when the driver has drained that step's batch, so the window's consume-
        time figures (staleness, stale groups filtered) describe the batch logged with that step.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the buffered groups after a restart (JSON-serialisable)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Wake every waiter; later put()/get() raise BufferClosed. Buffered groups stay in state_dict()."""

    def __len__(self) -> int:
        return 0

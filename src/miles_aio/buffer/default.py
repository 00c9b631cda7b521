"""`DefaultDataBuffer`: a bounded FIFO of finished groups with put-time and get-time filters.

put (rollout worker):
  0. any FAILED sample         → ctx.on_unused(item, "failed") (user code raised under a drop/retry
                                 --rollout-failure-policy); counted in rollout/failed_groups
  1. any ABORTED sample        → ctx.on_unused(item, "aborted"); counted in aborted_groups_filtered
  2. dynamic filter rejects    → ctx.on_filtered(item, reason); counted as drop_<reason> (a filter
                                 that raised: drop_filter_crashed, or under --rollout-failure-policy
                                 fail its exception propagates from put(); see fates.normalize_filter)
  3. otherwise wait while full (capacity = floor(factor × rollout_batch_size)), then append.
get (driver, `get(current_version=v, **context)`; context keys it does not know are ignored):
  wait while empty; pop the oldest; if its staleness > --max-weight-staleness → ctx.on_unused(item,
  "stale") and try the next one. Unknown staleness (no version yet) is never filtered.

Metric window (reset by each get_metrics() call): rollout/fully_async/{queue_size,
aborted_groups_filtered, stale_groups_filtered, avg_staleness, max_staleness, buffer_avg_staleness,
buffer_max_staleness} and rollout/dynamic_filter/drop_<reason>. avg/max cover the groups get() popped
in the window, those the staleness filter rejected included (as miles counts them); the buffer_* pair
covers the groups still buffered, at the last version seen. A staleness figure over no group of known
staleness (before the first push, an empty window or buffer) is left out, not reported as 0.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from miles_aio._notify import Notifier
from miles_aio.buffer.base import DataBuffer, DataBufferContext
from miles_aio.errors import BufferClosed
from miles_aio.types import BufferItem, Status, group_staleness

__all__ = ["DefaultDataBuffer"]

_P = "rollout/fully_async/"


class DefaultDataBuffer(DataBuffer):
    def __init__(self, ctx: DataBufferContext) -> None:
        super().__init__(ctx)
        self.capacity = ctx.config.buffer_capacity_groups
        self._max_staleness = ctx.config.buffer.max_weight_staleness
        self._items: deque[BufferItem] = deque()
        self._changed = Notifier()
        self._closed = False
        self._version: int | None = None
        self._reset_window()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: BufferItem) -> None:
        self._check_open()
        if any(s.status == Status.FAILED for s in item.group):
            self._failed += 1
            self.ctx.on_unused(item, "failed")
            return
        if any(s.status == Status.ABORTED for s in item.group):
            self._aborted += 1
            self.ctx.on_unused(item, "aborted")
            return
        if self.ctx.dynamic_filter is not None:
            decision = self.ctx.dynamic_filter(item.group)
            if not decision.keep:
                self._drops[decision.reason] += 1
                self.ctx.on_filtered(item, decision.reason)
                return
        await self._changed.wait_until(lambda: self._closed or len(self._items) < self.capacity)
        self._check_open()
        self._items.append(item)
        self._changed.notify()

    async def get(self, *, current_version: int | None = None, **context: Any) -> BufferItem:
        """The oldest group within --max-weight-staleness (older ones go to the unused handler); keys of
        `context` this buffer does not know are ignored."""
        if current_version is not None:
            self._version = current_version
        while True:
            await self._changed.wait_until(lambda: self._closed or bool(self._items))
            self._check_open()
            item = self._items.popleft()
            self._changed.notify()  # room for a blocked producer
            staleness = group_staleness(item.group, current_version)
            if staleness is not None:  # every popped group, the stale ones filtered below too (as miles)
                self._consumed_staleness.append(staleness)
            if staleness is not None and self._max_staleness is not None and staleness > self._max_staleness:
                self._stale += 1
                self.ctx.on_unused(item, "stale")
                continue
            return item

    def get_metrics(self) -> dict[str, float]:
        consumed = self._consumed_staleness
        buffered = [st for it in self._items if (st := group_staleness(it.group, self._version)) is not None]
        metrics: dict[str, float] = {
            _P + "queue_size": float(len(self._items)),
            _P + "aborted_groups_filtered": float(self._aborted),
            _P + "stale_groups_filtered": float(self._stale),
        }
        # Unknown staleness is absent, never 0: no group popped with a known staleness (before the
        # first push, an empty window), no buffered group with one (an empty buffer).
        if consumed:
            metrics[_P + "avg_staleness"] = sum(consumed) / len(consumed)
            metrics[_P + "max_staleness"] = float(max(consumed))
        if buffered:
            metrics[_P + "buffer_avg_staleness"] = sum(buffered) / len(buffered)
            metrics[_P + "buffer_max_staleness"] = float(max(buffered))
        metrics["rollout/failed_groups"] = float(self._failed)
        for reason, n in self._drops.items():
            metrics[f"rollout/dynamic_filter/drop_{reason}"] = float(n)
        self._reset_window()
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"items": [it.to_dict() for it in self._items], "version": self._version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._items = deque(BufferItem.from_dict(d) for d in state["items"])
        self._version = state.get("version")

    def close(self) -> None:
        self._closed = True
        self._changed.notify()

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosed("the data buffer is closed")

    def _reset_window(self) -> None:
        self._aborted = 0
        self._failed = 0
        self._stale = 0
        self._drops: Counter[str] = Counter()
        self._consumed_staleness: list[int] = []

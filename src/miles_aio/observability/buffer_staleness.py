"""Consume staleness for any buffer: the runtime measures the groups `get()` returns.

`DefaultDataBuffer` reports `rollout/fully_async/avg_staleness` and `max_staleness` itself; a custom
buffer (`--custom-async-data-buffer-path`) owns its metrics and often reports neither, which used to
leave the run without consume staleness and its staleness plot without a line. `with_staleness_metrics`
derives a class from the buffer's that records the staleness of every group its `get()` returns
(against the `current_version` the driver passed) and adds the two figures to `get_metrics()` when the
buffer did not report them. Everything else is the buffer's own: the class keeps its name and module,
`isinstance` holds, and a buffer that reports the figures keeps its values. Groups the buffer filters
inside `get()` are not seen here (the default buffer counts them); unknown staleness (before the first
push) is absent, never 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_aio.buffer.base import DataBuffer
from miles_aio.types import BufferItem, group_staleness

__all__ = ["CONSUME_STALENESS", "consume_staleness_metrics", "with_staleness_metrics"]

CONSUME_STALENESS = ("rollout/fully_async/avg_staleness", "rollout/fully_async/max_staleness")


def consume_staleness_metrics(staleness: Sequence[int]) -> dict[str, float]:
    """avg/max of the known staleness of the groups consumed in a window; {} for none (unknown)."""
    if not staleness:
        return {}
    avg, top = CONSUME_STALENESS
    return {avg: sum(staleness) / len(staleness), top: float(max(staleness))}


def with_staleness_metrics(cls: type[DataBuffer]) -> type[DataBuffer]:
    """`cls`, measured: its consume staleness reported by the runtime where it reports none."""
    if getattr(cls, "_runtime_measures_staleness", False):
        return cls

    class Measured(cls):  # type: ignore[valid-type,misc]  # a base chosen at run time, by design
        _runtime_measures_staleness = True

        async def get(self, *, current_version: int | None = None, **context: Any) -> BufferItem:
            item: BufferItem = await super().get(current_version=current_version, **context)
            staleness = group_staleness(item.group, current_version)
            if staleness is not None:
                self.__dict__.setdefault("_runtime_consumed_staleness", []).append(staleness)
            return item

        def get_metrics(self) -> dict[str, float]:
            metrics: dict[str, float] = super().get_metrics()
            measured = self.__dict__.pop("_runtime_consumed_staleness", [])
            if not any(k in metrics for k in CONSUME_STALENESS):
                metrics.update(consume_staleness_metrics(measured))
            return metrics

    for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
        setattr(Measured, attr, getattr(cls, attr))
    return Measured

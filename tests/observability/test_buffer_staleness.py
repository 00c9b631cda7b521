"""A custom buffer that reports no staleness still gives the run its consume staleness (and its plot)."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, ClassVar

import pytest

from miles_aio._notify import Notifier
from miles_aio.buffer import DataBuffer, DataBufferContext, DefaultDataBuffer
from miles_aio.errors import BufferClosed
from miles_aio.observability.buffer_staleness import (
    CONSUME_STALENESS,
    consume_staleness_metrics,
    with_staleness_metrics,
)
from miles_aio.types import BufferItem, Sample, group_staleness
from tests.helpers import make_config
from tests.observability._run import run_controller

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]


class QuietFifo(DataBuffer):
    """A FIFO that reports its queue size and nothing else; it records what it served, for the test."""

    taken: ClassVar[dict[int, int]] = {}

    def __init__(self, ctx: DataBufferContext) -> None:
        super().__init__(ctx)
        self.capacity = ctx.config.buffer_capacity_groups
        self._items: deque[BufferItem] = deque()
        self._changed = Notifier()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: BufferItem) -> None:
        await self._changed.wait_until(lambda: self._closed or len(self._items) < self.capacity)
        if self._closed:
            raise BufferClosed("closed")
        self._items.append(item)
        self._changed.notify()

    async def get(self, *, current_version: int | None = None, **context: Any) -> BufferItem:
        await self._changed.wait_until(lambda: self._closed or bool(self._items))
        if self._closed:
            raise BufferClosed("closed")
        item = self._items.popleft()
        self._changed.notify()
        if (staleness := group_staleness(item.group, current_version)) is not None:
            QuietFifo.taken[item.group_index] = staleness
        return item

    def get_metrics(self) -> dict[str, float]:
        return {"rollout/fully_async/queue_size": float(len(self._items))}

    def state_dict(self) -> dict[str, Any]:
        return {"items": [it.to_dict() for it in self._items]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._items = deque(BufferItem.from_dict(d) for d in state["items"])

    def close(self) -> None:
        self._closed = True
        self._changed.notify()


class ReportingFifo(QuietFifo):
    def get_metrics(self) -> dict[str, float]:
        return {"rollout/fully_async/avg_staleness": 42.0}


def test_consume_staleness_metrics_is_absent_when_unknown() -> None:
    assert consume_staleness_metrics([]) == {}
    assert consume_staleness_metrics([1, 2, 4]) == dict(zip(CONSUME_STALENESS, [7 / 3, 4.0], strict=True))


def test_the_measured_class_keeps_the_buffers_identity() -> None:
    measured = with_staleness_metrics(QuietFifo)
    assert issubclass(measured, QuietFifo)
    assert (measured.__name__, measured.__qualname__, measured.__module__) == (
        "QuietFifo",
        "QuietFifo",
        __name__,
    )
    assert with_staleness_metrics(measured) is measured  # not wrapped twice


def item(gid: int, version: int) -> BufferItem:
    s = Sample(group_index=gid, index=gid, prompt="p", response_length=1, weight_versions=[version])
    return BufferItem(group=[s], prompt_group=[s])


def ctx() -> DataBufferContext:
    cfg = make_config(rollout_batch_size=4)
    return DataBufferContext(config=cfg, on_unused=lambda it, why: None, on_filtered=lambda it, why: None)


def test_a_buffers_own_figures_are_kept_and_the_window_resets(vrun: Any) -> None:
    async def main() -> None:
        quiet, reporting = (
            with_staleness_metrics(QuietFifo)(ctx()),
            with_staleness_metrics(ReportingFifo)(ctx()),
        )
        for buf in (quiet, reporting):
            await buf.put(item(0, 1))
            await buf.put(item(1, 3))
            await buf.get(current_version=4)
            await buf.get(current_version=4)
        assert quiet.get_metrics() == {
            "rollout/fully_async/queue_size": 0.0,
            "rollout/fully_async/avg_staleness": 2.0,
            "rollout/fully_async/max_staleness": 3.0,
        }
        assert quiet.get_metrics() == {"rollout/fully_async/queue_size": 0.0}  # an empty window: unknown
        assert reporting.get_metrics() == {"rollout/fully_async/avg_staleness": 42.0}
        await quiet.put(item(2, 1))
        await quiet.get(current_version=None)  # before the first push: unknown, so absent
        assert set(quiet.get_metrics()) == {"rollout/fully_async/queue_size"}

    vrun(main())


def test_a_run_with_a_quiet_custom_buffer_logs_its_consume_staleness(vrun: Any, tmp_path: Path) -> None:
    QuietFifo.taken = {}
    run_dir = tmp_path / "run"
    controller, _ = run_controller(
        vrun,
        run_dir,
        num_rollout=6,
        async_max_concurrent_samples=16,
        custom_async_data_buffer_path=f"{__name__}:QuietFifo",
    )
    assert isinstance(controller.buffer, QuietFifo) and not isinstance(controller.buffer, DefaultDataBuffer)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for (step, batch), record in zip(controller.trainer.steps, records, strict=True):  # type: ignore[attr-defined]
        values = [QuietFifo.taken[g[0].group_index] for g in batch]
        assert record["rollout/fully_async/max_staleness"] == max(values), step
        assert record["rollout/fully_async/avg_staleness"] == pytest.approx(sum(values) / len(values)), step

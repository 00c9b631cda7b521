"""DefaultDataBuffer on virtual time: capacity, filters, handler routing, metrics window, close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from miles_aio.buffer import BufferItem, DataBufferContext, DefaultDataBuffer, FilterDecision
from miles_aio.errors import BufferClosed
from miles_aio.types import FinishReason, GenerateOutput, Group, Sample
from tests.helpers import make_config

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(20)]


def item(gid: int, versions: list[int | None], finish: FinishReason = "stop") -> BufferItem:
    group: Group = []
    for k, v in enumerate(versions):
        s = Sample(group_index=gid, index=gid * 10 + k, prompt="p")
        s.append(
            GenerateOutput(
                text="a", output_ids=[1], output_log_probs=[0.0], weight_versions=[v], finish_reason=finish
            )
        )
        group.append(s)
    return BufferItem(group=group, prompt_group=[Sample(group_index=gid, index=gid * 10, prompt="p")])


def make_buffer(
    fates: list[tuple[str, int, str]], *, dynamic: Callable[[Group], FilterDecision] | None = None, **cfg: Any
) -> DefaultDataBuffer:
    return DefaultDataBuffer(
        DataBufferContext(
            config=make_config(**cfg),
            on_unused=lambda it, why: fates.append(("unused", it.group_index, why)),
            on_filtered=lambda it, why: fates.append(("filtered", it.group_index, why)),
            dynamic_filter=dynamic,
        )
    )


def test_capacity_is_factor_times_batch_and_a_full_buffer_blocks_the_producer(vrun: Any) -> None:
    fates: list[tuple[str, int, str]] = []
    buf = make_buffer(fates, rollout_batch_size=2, async_data_buffer_capacity_factor=1.5)
    assert buf.capacity == 3

    async def main() -> None:
        for g in range(3):
            await buf.put(item(g, [1]))
        blocked = asyncio.create_task(buf.put(item(3, [1])))
        await asyncio.sleep(5)
        assert not blocked.done() and len(buf) == 3  # the fourth put waits: no eviction
        got = await buf.get(current_version=1)
        assert got.group_index == 0  # FIFO
        await asyncio.wait_for(blocked, timeout=1)
        assert len(buf) == 3

    vrun(main())


def test_aborted_groups_go_to_the_unused_handler_and_dynamic_rejects_are_filtered(vrun: Any) -> None:
    fates: list[tuple[str, int, str]] = []
    buf = make_buffer(fates, dynamic=lambda g: FilterDecision(g[0].group_index != 2, "zero_std"))

    async def main() -> None:
        await buf.put(item(1, [1, 1], finish="abort"))
        await buf.put(item(2, [1, 1]))
        await buf.put(item(3, [1, 1]))
        assert len(buf) == 1
        m = buf.get_metrics()
        assert m["rollout/fully_async/aborted_groups_filtered"] == 1
        assert m["rollout/dynamic_filter/drop_zero_std"] == 1
        assert m["rollout/fully_async/queue_size"] == 1

    vrun(main())
    assert fates == [("unused", 1, "aborted"), ("filtered", 2, "zero_std")]


def test_get_filters_stale_groups_but_never_unknown_staleness(vrun: Any) -> None:
    fates: list[tuple[str, int, str]] = []
    buf = make_buffer(fates, max_weight_staleness=1)

    async def main() -> list[int]:
        await buf.put(item(1, [1, 3]))  # oldest 1 → staleness 3 at version 4: stale
        await buf.put(item(2, [None]))  # unknown: never filtered
        await buf.put(item(3, [3, 4]))  # staleness 1: kept
        got = [(await buf.get(current_version=4)).group_index for _ in range(2)]
        m = buf.get_metrics()
        assert m["rollout/fully_async/stale_groups_filtered"] == 1
        # every popped group of known staleness counts, the one the filter rejected too (as miles):
        # groups 1 (3, rejected) and 3 (1); group 2's unknown staleness is not a 0
        assert m["rollout/fully_async/avg_staleness"] == 2.0
        assert m["rollout/fully_async/max_staleness"] == 3.0
        return got

    assert vrun(main()) == [2, 3]
    assert fates == [("unused", 1, "stale")]


def test_metrics_window_resets_on_each_call_and_reports_buffered_staleness(vrun: Any) -> None:
    fates: list[tuple[str, int, str]] = []
    buf = make_buffer(fates)

    async def main() -> None:
        await buf.put(item(1, [2]))
        await buf.put(item(2, [1], finish="abort"))
        await buf.put(item(3, [1]))
        await buf.get(current_version=3)
        first = buf.get_metrics()
        assert first["rollout/fully_async/aborted_groups_filtered"] == 1
        assert first["rollout/fully_async/avg_staleness"] == 1.0
        assert first["rollout/fully_async/buffer_avg_staleness"] == 2.0  # group 3, at version 3
        assert first["rollout/fully_async/buffer_max_staleness"] == 2.0
        second = buf.get_metrics()
        assert second["rollout/fully_async/aborted_groups_filtered"] == 0
        assert "rollout/fully_async/avg_staleness" not in second  # nothing popped: unknown, not 0
        assert "rollout/fully_async/max_staleness" not in second
        assert second["rollout/fully_async/buffer_max_staleness"] == 2.0
        assert second["rollout/fully_async/queue_size"] == 1

    vrun(main())


def test_unknown_staleness_is_absent_from_the_metrics_not_zero(vrun: Any) -> None:
    """Before the first push (no version yet) and with an empty buffer there is no staleness to report:
    the four staleness metrics are left out (a 0 would read as "perfectly fresh")."""
    buf = make_buffer([])
    staleness = {
        f"rollout/fully_async/{k}"
        for k in ("avg_staleness", "max_staleness", "buffer_avg_staleness", "buffer_max_staleness")
    }

    async def main() -> None:
        empty = buf.get_metrics()
        assert staleness.isdisjoint(empty) and empty["rollout/fully_async/queue_size"] == 0
        await buf.put(item(1, [None]))  # generated before any version was stamped
        await buf.put(item(2, [1]))
        await buf.get(current_version=None)  # the driver holds no version yet
        before_push = buf.get_metrics()
        assert staleness.isdisjoint(before_push) and before_push["rollout/fully_async/queue_size"] == 1
        await buf.get(current_version=2)
        drained = buf.get_metrics()  # group 2 popped at version 2; the buffer is empty
        assert (
            drained["rollout/fully_async/avg_staleness"] == drained["rollout/fully_async/max_staleness"] == 1
        )
        assert "rollout/fully_async/buffer_avg_staleness" not in drained
        assert "rollout/fully_async/buffer_max_staleness" not in drained

    vrun(main())


def test_get_ignores_context_keys_it_does_not_know(vrun: Any) -> None:
    """The driver may pass more keywords to get() than a buffer knows (forward compatibility, as miles'
    `get(self, **context)`): the default buffer ignores them, and a user buffer written as
    `def get(self, **kwargs)` over it works, including get() with no version at all."""

    class KwargsBuffer(DefaultDataBuffer):
        async def get(self, **kwargs: Any) -> BufferItem:
            self.seen = dict(kwargs)
            return await super().get(**kwargs)

    buf = make_buffer([])
    mine = KwargsBuffer(buf.ctx)

    async def main() -> None:
        await buf.put(item(1, [1]))
        await buf.put(item(2, [1]))
        assert (await buf.get(current_version=2, step=7, future_key="x")).group_index == 1
        assert (await buf.get()).group_index == 2  # no version: staleness unknown
        await mine.put(item(3, [1]))
        assert (await mine.get(current_version=2, step=7)).group_index == 3
        assert mine.seen == {"current_version": 2, "step": 7}
        assert mine.get_metrics()["rollout/fully_async/max_staleness"] == 1.0

    vrun(main())


def test_close_wakes_every_waiter_and_keeps_state(vrun: Any) -> None:
    buf = make_buffer([], rollout_batch_size=1, async_data_buffer_capacity_factor=1.0)

    async def main() -> None:
        getter_buf = make_buffer([])
        getter = asyncio.create_task(getter_buf.get(current_version=1))
        await buf.put(item(1, [1]))
        putter = asyncio.create_task(buf.put(item(2, [1])))
        await asyncio.sleep(1)
        buf.close()
        getter_buf.close()
        with pytest.raises(BufferClosed):
            await putter
        with pytest.raises(BufferClosed):
            await getter
        with pytest.raises(BufferClosed):
            await buf.get(current_version=1)
        assert [d["group"][0]["group_index"] for d in buf.state_dict()["items"]] == [1]

    vrun(main())


def test_state_dict_round_trip(vrun: Any) -> None:
    buf = make_buffer([])

    async def main() -> None:
        await buf.put(item(1, [1]))
        await buf.put(item(2, [2]))
        again = make_buffer([])
        again.load_state_dict(buf.state_dict())
        assert [(await again.get(current_version=2)).group_index for _ in range(2)] == [1, 2]

    vrun(main())

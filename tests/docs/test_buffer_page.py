"""The fully async page's example buffer keeps the DataBuffer contract: `close()` wakes every waiter."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles_aio import BufferItem, DataBufferContext, Sample
from miles_aio.errors import BufferClosed
from tests.docs._docs import DOCS, fenced_blocks
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(30)


def page_buffer_class() -> Any:
    """`BestFirstBuffer`, executed as the page shows it (its own demo runs too)."""
    text = (DOCS / "guide" / "fully-async.md").read_text(encoding="utf-8")
    code = next(c for c, runnable in fenced_blocks(text, "python") if runnable and "(DataBuffer)" in c)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    exec(compile(code, "docs/guide/fully-async.md", "exec"), namespace)
    return namespace["BestFirstBuffer"]


def item(gid: int, reward: float) -> BufferItem:
    group = [Sample(group_index=gid, index=gid, prompt="1+1=", reward=reward)]
    return BufferItem(group=group, prompt_group=group)


@pytest.fixture(scope="module")
def buffer_cls() -> Any:
    return page_buffer_class()


def new_buffer(cls: Any, batch: int) -> Any:
    cfg = make_config(rollout_batch_size=batch, async_data_buffer_capacity_factor=1.0)
    ctx = DataBufferContext(config=cfg, on_unused=lambda it, why: None, on_filtered=lambda it, why: None)
    return cls(ctx)


def test_close_wakes_a_waiting_get_and_a_blocked_put(buffer_cls: Any) -> None:
    async def main() -> None:
        empty, full = new_buffer(buffer_cls, 1), new_buffer(buffer_cls, 1)
        await full.put(item(0, 0.5))  # capacity 1: the next put blocks
        getter = asyncio.create_task(empty.get(current_version=None))
        putter = asyncio.create_task(full.put(item(1, 0.9)))
        await asyncio.sleep(0.01)
        assert not getter.done() and not putter.done()  # both wait
        empty.close()
        full.close()
        done, pending = await asyncio.wait({getter, putter}, timeout=1.0)
        assert not pending, "close() left a waiter asleep"
        for task in done:
            assert isinstance(task.exception(), BufferClosed)
        with pytest.raises(BufferClosed):
            await empty.get(current_version=None)
        with pytest.raises(BufferClosed):
            await full.put(item(2, 0.1))
        assert len(full) == 1  # buffered groups stay (state_dict)

    asyncio.run(main())


def test_put_get_best_first_and_a_cancelled_get_loses_nothing(buffer_cls: Any) -> None:
    async def main() -> None:
        buf = new_buffer(buffer_cls, 3)
        getter = asyncio.create_task(buf.get(current_version=None, future_key="ignored"))
        await asyncio.sleep(0)
        for gid, reward in [(0, 0.2), (1, 0.9), (2, 0.5)]:
            await buf.put(item(gid, reward))
        assert (await getter).group_index == 1  # the waiter wakes to the best group
        cancelled = asyncio.create_task(buf.get(current_version=None))
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert [(await buf.get(current_version=3)).group_index for _ in range(2)] == [2, 0]
        restored = new_buffer(buffer_cls, 3)
        await buf.put(item(4, 0.1))
        restored.load_state_dict(buf.state_dict())
        assert (await restored.get(current_version=None)).group_index == 4

    asyncio.run(main())

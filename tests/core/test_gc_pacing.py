"""`paced_gc()`: rare full collections, shorter young ones, startup objects frozen — all undone on exit."""

from __future__ import annotations

import asyncio
import gc

import pytest

from miles_aio._gc import FULL_EVERY, YOUNG_EVERY, paced_gc

pytestmark = pytest.mark.pure


def test_paced_gc_paces_the_collector_for_the_block_and_restores_it() -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()

    async def one(started: asyncio.Event, release: asyncio.Event) -> tuple[int, int, int]:
        async with paced_gc():
            started.set()
            await release.wait()
            return gc.get_threshold()

    async def main() -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        # two overlapping blocks (two controllers in one process), the first one ending first
        a_in, a_out, b_in, b_out = (asyncio.Event() for _ in range(4))
        a = asyncio.create_task(one(a_in, a_out))
        await a_in.wait()
        b = asyncio.create_task(one(b_in, b_out))
        await b_in.wait()
        a_out.set()
        seen_a = await a
        frozen = gc.get_freeze_count()  # b still runs: still frozen and paced
        still = gc.get_threshold()
        b_out.set()
        await b
        return seen_a, still, frozen

    seen, still, frozen_inside = asyncio.run(main())
    assert seen == (before[0], min(before[1], YOUNG_EVERY), max(before[2], FULL_EVERY))
    assert still == seen
    assert frozen_inside > frozen_before
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_paced_gc_restores_the_collector_when_the_block_raises() -> None:
    before = gc.get_threshold()

    async def main() -> None:
        async with paced_gc():
            raise KeyError("boom")

    with pytest.raises(KeyError):
        asyncio.run(main())
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0

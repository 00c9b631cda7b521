"""`paced_gc()`: full collections at most every `FULL_EVERY_S` seconds, shorter young ones, startup objects
frozen — all undone on exit."""

from __future__ import annotations

import asyncio
import gc

import pytest

from miles_aio import _gc
from miles_aio._gc import FULL_EVERY, OUT_OF_REACH, YOUNG_EVERY, YOUNG_EVERY_REQUESTS, FullPassPacer, paced_gc

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
    assert seen == (before[0], min(before[1], YOUNG_EVERY), OUT_OF_REACH)
    assert still == seen
    assert frozen_inside > frozen_before
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    assert not any(isinstance(c, FullPassPacer) for c in gc.callbacks)


def test_paced_gc_restores_the_collector_when_the_block_raises() -> None:
    before = gc.get_threshold()

    async def main() -> None:
        async with paced_gc():
            raise KeyError("boom")

    with pytest.raises(KeyError):
        asyncio.run(main())
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_the_pacer_lets_a_full_pass_come_only_once_its_interval_passed() -> None:
    now = [100.0]
    pacer = FullPassPacer(60.0, clock=lambda: now[0])
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 2, OUT_OF_REACH)
        now[0] = 159.0
        pacer("stop", {"generation": 1})
        assert gc.get_threshold() == (700, 2, OUT_OF_REACH)
        pacer("start", {"generation": 1})
        pacer("stop", {"generation": 0})
        now[0] = 160.0
        assert gc.get_threshold()[2] == OUT_OF_REACH
        pacer("stop", {"generation": 1})
        assert gc.get_threshold() == (700, 2, FULL_EVERY)
        now[0] = 161.0
        pacer("stop", {"generation": 2})  # the full pass (or a gc.collect()) restarts the interval
        assert gc.get_threshold() == (700, 2, OUT_OF_REACH)
        assert (pacer.last_full, pacer.full_passes) == (161.0, 1)
        now[0] = 200.0
        pacer("stop", {"generation": 1})
        assert gc.get_threshold()[2] == OUT_OF_REACH
    finally:
        gc.set_threshold(*before)


def _full_passes_while_allocating(every_s: float, monkeypatch: pytest.MonkeyPatch) -> int:
    """Full passes the collector makes on its own inside `paced_gc` while ~2,000 generation-1 passes'
    worth of containers are made, a third of them kept (they reach the oldest generation, as in-flight
    samples do)."""
    monkeypatch.setattr(_gc, "FULL_EVERY_S", every_s)
    full = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        full[0] += phase == "stop" and info["generation"] == 2

    async def main() -> None:
        async with paced_gc():
            gc.callbacks.append(count)
            try:
                kept = []
                for i in range(6 * FULL_EVERY * YOUNG_EVERY * gc.get_threshold()[0]):
                    item = {"i": [i]}
                    if i % 3 == 0:
                        kept.append(item)
            finally:
                gc.callbacks.remove(count)

    asyncio.run(main())
    return full[0]


def test_no_full_pass_runs_before_its_interval_and_one_does_after(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _full_passes_while_allocating(3600.0, monkeypatch) == 0
    assert _full_passes_while_allocating(0.0, monkeypatch) >= 1


class _Node:
    """A tracked object, as a request's futures and coroutines are (a dict of atomic values is not)."""


def _young_objects_while_replacing_old_ones(n: int, *, requests: bool) -> int:
    """The most objects the young generations held while `n` old objects were freed and `n` new ones
    kept, one of each per "request" (a finished request's objects are old: they lived for its seconds),
    with `request_done()` after each one or not."""
    most = 0

    async def main() -> None:
        nonlocal most
        old = [_Node() for _ in range(n)]
        async with paced_gc():  # freezes `old`: the oldest objects there are
            new = []
            for i in range(n):
                new.append(_Node())
                old.pop()
                if requests:
                    _gc.request_done()
                if i % 500 == 0:
                    most = max(most, len(gc.get_objects(0)) + len(gc.get_objects(1)))

    asyncio.run(main())
    return most


def test_young_passes_paced_by_requests_keep_the_young_generation_small() -> None:
    # CPython counts tracked allocations minus deallocations, old or young: freeing an old object per
    # new one keeps the count under its threshold, and the young generation grows without a pass
    assert _young_objects_while_replacing_old_ones(20_000, requests=False) > 19_000
    assert _young_objects_while_replacing_old_ones(20_000, requests=True) < 10 * YOUNG_EVERY_REQUESTS


def test_request_done_collects_the_young_generations_every_n_requests_inside_a_block_only() -> None:
    passes: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            passes.append(info["generation"])

    async def requests(k: int) -> None:
        for _ in range(k):
            _gc.request_done()

    async def main() -> list[int]:
        async with paced_gc():
            gc.callbacks.append(seen)
            try:
                await requests(YOUNG_EVERY_REQUESTS - 1)
                before = list(passes)
                await requests(1)
                return before
            finally:
                gc.callbacks.remove(seen)

    gc.disable()  # no automatic pass in the way: only the paced ones are counted
    try:
        assert asyncio.run(main()) == []
        assert passes == [1]
        passes.clear()
        gc.callbacks.append(seen)
        try:
            for _ in range(3 * YOUNG_EVERY_REQUESTS):
                _gc.request_done()  # no block: the collector is left as it is
        finally:
            gc.callbacks.remove(seen)
        assert passes == []
    finally:
        gc.enable()

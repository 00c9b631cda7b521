"""A step's rollout/* metrics over a big batch let the event loop run between chunks
(`Controller._batch_metrics`), and give what the one-go function gives; the recorded batch is let go of
in chunks too (`Controller._free`)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from miles_aio.buffer import BufferItem
from miles_aio.controller import METRICS_CHUNK_SAMPLES, Controller
from miles_aio.metrics import rollout_batch_metrics
from miles_aio.types import GenerateOutput, Group, Sample

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(20)]


def _out(n: int, versions: Sequence[int | None]) -> GenerateOutput:
    ids, logps = [5] * n, [-1.0] * n
    return GenerateOutput(
        text="", output_ids=ids, output_log_probs=logps, weight_versions=list(versions), finish_reason="stop"
    )


def _group(gid: int, n: int) -> Group:
    group = []
    for k in range(n):
        s = Sample(group_index=gid, index=gid * n + k, prompt="p", tokens=[1, 2], reward=float(k % 2))
        s.append(_out(30, [3] * 10 + [4] * 20))  # two policies: a push landed mid-request
        s.append(_out(8, [gid % 5 + 1] * 8))
        group.append(s)
    return group


def test_batch_metrics_yield_between_chunks_and_read_the_version_once(vrun: Any) -> None:
    groups = [_group(g, 8) for g in range(400)]  # 3,200 samples: a dozen chunks
    fake_controller = SimpleNamespace(version=7, cfg=SimpleNamespace(train=SimpleNamespace(reward_key=None)))
    passes = 0

    async def other_task() -> None:  # what a rollout does meanwhile: runs, and sees a push land
        nonlocal passes
        while True:
            await asyncio.sleep(0)
            passes += 1
            fake_controller.version = 8

    async def main() -> dict[str, float]:
        async with asyncio.TaskGroup() as tg:
            other = tg.create_task(other_task())
            await asyncio.sleep(0)
            fake_controller.version = 7
            passes_before = passes
            metrics = await Controller._batch_metrics(fake_controller, groups)  # type: ignore[arg-type]
            assert passes - passes_before >= 3200 // METRICS_CHUNK_SAMPLES - 1
            other.cancel()
        return metrics

    metrics = vrun(main())
    assert metrics == rollout_batch_metrics(groups, version=7)
    assert metrics["rollout/train_staleness_max"] == 7 - 1


def test_a_recorded_batch_is_let_go_of_a_chunk_at_a_time(vrun: Any) -> None:
    """`Controller._free`: the samples of a recorded batch go `METRICS_CHUNK_SAMPLES` at a time, the loop
    let run between chunks, until nothing is held (freeing 50,000 samples at once stalled the loop)."""
    groups = [_group(g, 8) for g in range(400)]  # 3,200 samples
    batch = [BufferItem(group=group, prompt_group=group) for group in groups]
    del groups
    seen: list[int] = []

    async def watcher() -> None:  # what a rollout sees between two passes of the loop
        while batch:
            seen.append(len(batch))
            await asyncio.sleep(0)

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(watcher())
            await asyncio.sleep(0)
            await Controller._free(batch)

    vrun(main())
    assert batch == []
    drops = [a - b for a, b in itertools.pairwise(seen)]
    assert max(drops) * 8 == METRICS_CHUNK_SAMPLES and len(seen) >= 3200 // METRICS_CHUNK_SAMPLES


class FakeFullBuffer:
    """A FAKE buffer that is full: every `get` returns its oldest group at once, without a wait."""

    def __init__(self, items: list[BufferItem]) -> None:
        self.items = items

    async def get(self, *, current_version: int | None = None) -> BufferItem:
        return self.items.pop(0)

    def get_metrics(self) -> dict[str, float]:
        return {}


def test_a_full_buffer_is_drained_a_chunk_at_a_time(vrun: Any) -> None:
    """`Controller._drain`: groups a full buffer hands over without a wait are taken
    `METRICS_CHUNK_SAMPLES` samples at a time, the loop let run between chunks (a step's worth in one
    callback held the loop for 10+ ms at 50,000 in flight), into `_draining` (what a stop keeps)."""
    groups = [_group(g, 8) for g in range(400)]  # 3,200 samples
    consumed: list[int] = []
    fake_controller = SimpleNamespace(
        cfg=SimpleNamespace(
            rollout=SimpleNamespace(rollout_batch_size=400), driver=SimpleNamespace(stall_warning_s=60.0)
        ),
        buffer=FakeFullBuffer([BufferItem(group=g, prompt_group=g) for g in reversed(groups)]),
        version=3,
        _carry=[],
        _draining=[],
        _drained_metrics={},
        _raise_if_worker_died=lambda step: None,
        _consumed=lambda item: consumed.append(item.group_index),
    )
    seen: list[int] = []

    async def watcher() -> None:  # what a rollout sees between two passes of the loop
        while len(seen) < 2 or seen[-1] != 0:
            seen.append(len(fake_controller._draining))
            await asyncio.sleep(0)

    async def main() -> list[BufferItem]:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(watcher())
            await asyncio.sleep(0)
            return await Controller._drain(fake_controller, step=1)  # type: ignore[arg-type]

    batch = vrun(main())
    assert [it.group_index for it in batch] == list(range(400))  # sorted by sample index
    assert sorted(consumed) == list(range(400)) and fake_controller._draining == []
    rises = [b - a for a, b in itertools.pairwise(seen) if b > a]
    assert max(rises) * 8 == METRICS_CHUNK_SAMPLES and len(rises) >= 3200 // METRICS_CHUNK_SAMPLES - 1

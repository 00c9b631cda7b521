"""`paced_gc()`: keep CPython's cyclic garbage collector from stalling the controller's event loop.

    async with paced_gc(), asyncio.TaskGroup() as tg: ...     # Controller.run

The collector stops the whole process while it walks the containers of a generation. With 10,000
samples in flight the controller holds ~700k tracked objects (coroutines, tasks, futures, samples and
their per-token lists, the dataset), nearly all alive by design, so each full (generation 2) pass took
0.6–1.3 s of loop time every few seconds and freed nothing (`benchmarks.soak` on 2 shared cores: 21
full passes, 12 s of a 60 s run; loop lag p99 24 ms, max 1.4 s); young passes grow with the objects that
survive them, which here is most of them (generation-1 passes of 9.5 ms on average). At 50,000 in
flight a full pass takes 2–3 s, and each one leaves a backlog that keeps the loop late for several
hundred milliseconds after it: with full passes every `FULL_EVERY` generation-1 passes (~35 s at 3,000
requests/s), 17 of them in a 10-minute soak put the loop lag's p99 at 213 ms.

While the controller runs:
* what exists at its start (modules, the dataset, the configuration) is moved to the permanent
  generation (`gc.freeze()`), so no pass walks it again;
* full collections run at most once every `FULL_EVERY_S` seconds of wall time (and no more often than
  every `FULL_EVERY` generation-1 passes): a `gc.callbacks` hook keeps the generation-2 threshold out of
  reach and lowers it once the interval has passed, so the next generation-1 pass becomes a full one.
  Young passes still run as usual, so short-lived cycles are freed promptly;
* generation 1 is collected every `YOUNG_EVERY` generation-0 passes instead of 10, so each of those
  passes walks fewer objects: more, shorter pauses (2.8 ms on average);
* young passes are also paced by work: every `YOUNG_EVERY_REQUESTS` engine requests (`request_done()`,
  called by the rollout context's engine) the young generations are collected. CPython starts a young
  pass when the tracked objects allocated *minus those freed* since the last one exceed 700, and freeing
  an old object counts like freeing a young one. In steady state the controller frees a finished
  request's objects (old by then: they lived for the request's seconds) about as fast as it makes the
  next one's, so that count stays near zero while the young generation grows by tens of thousands of
  objects, and the pass that finally comes walks them all: at 50,000 requests in flight, young passes
  of 10–30 ms that held the loop lag's p99 at 23–39 ms (`benchmarks.soak`). Counting requests bounds
  each pass by what a few dozen requests leave behind.

Non-cyclic garbage is freed by reference counting whatever the collector does; what waits longer is only
reference cycles that reached the oldest generation before they became garbage (`benchmarks.soak`
reports how many a final full pass finds, and the resident memory over the run). The previous
thresholds, hooks and frozen objects are restored when the last of overlapping blocks exits (two
controllers in one process may start and end in any order).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

__all__ = [
    "FULL_EVERY",
    "FULL_EVERY_S",
    "YOUNG_EVERY",
    "YOUNG_EVERY_REQUESTS",
    "FullPassPacer",
    "full_pass_due",
    "paced_gc",
    "request_done",
]

FULL_EVERY: Final = 1000
"""Generation-1 passes between two full collections, at least (CPython's default: 10)."""
FULL_EVERY_S = 600.0
"""Seconds of wall time between two full collections, at least, while a controller runs."""
YOUNG_EVERY: Final = 2
"""Generation-0 passes between two generation-1 passes (CPython's default: 10)."""
YOUNG_EVERY_REQUESTS: Final = 32
"""Engine requests between two young passes paced by work (`request_done`)."""
OUT_OF_REACH: Final = 2**30
"""A generation-2 threshold no count reaches: no automatic full pass."""


def full_pass_due(*, now: float, last_full: float, every_s: float) -> bool:
    """Whether the next generation-1 pass may be a full one."""
    return now - last_full >= every_s


class FullPassPacer:
    """A `gc.callbacks` hook: after each generation-1 pass, the generation-2 threshold is `FULL_EVERY`
    once a full pass is due (`full_pass_due`), else out of reach; a full pass (automatic or an explicit
    `gc.collect()`) restarts the interval. Runs inside the collector: it only sets thresholds."""

    def __init__(self, every_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.last_full = clock()
        self.full_passes = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase != "stop" or info["generation"] == 0:
            return
        young, middle, _ = gc.get_threshold()
        if info["generation"] == 2:
            self.last_full = self.clock()
            self.full_passes += 1
            gc.set_threshold(young, middle, OUT_OF_REACH)
        elif full_pass_due(now=self.clock(), last_full=self.last_full, every_s=self.every_s):
            gc.set_threshold(young, middle, FULL_EVERY)


_active: list[tuple[tuple[int, int, int], FullPassPacer]] = []
"""One entry per block in progress: the thresholds before the first of them, and its hook."""
_requests = 0
"""Engine requests done since the last young pass paced by work."""


def request_done() -> None:
    """One engine request finished: every `YOUNG_EVERY_REQUESTS`th, while a `paced_gc()` block runs,
    collect the young generations (the oldest too, once a full pass is due). Outside a block: nothing."""
    global _requests
    if not _active:
        return
    _requests += 1
    if _requests < YOUNG_EVERY_REQUESTS:
        return
    _requests = 0
    pacer = _active[0][1]
    full = full_pass_due(now=pacer.clock(), last_full=pacer.last_full, every_s=pacer.every_s)
    gc.collect(2 if full else 1)  # the pacer's hook sees it as any other pass


@contextlib.asynccontextmanager
async def paced_gc() -> AsyncIterator[None]:
    """Freeze what exists now and pace the collector as the module docstring says, for the block."""
    global _requests
    if _active:
        _active.append(_active[0])
    else:
        before = gc.get_threshold()
        _requests = 0
        gc.freeze()
        pacer = FullPassPacer(FULL_EVERY_S)
        gc.set_threshold(before[0], min(before[1], YOUNG_EVERY), OUT_OF_REACH)
        gc.callbacks.append(pacer)
        _active.append((before, pacer))
    try:
        yield
    finally:
        saved, hook = _active.pop()
        if not _active:
            gc.callbacks.remove(hook)
            gc.set_threshold(*saved)
            gc.unfreeze()

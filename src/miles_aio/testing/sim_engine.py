"""A FAKE engine whose throughput degrades with concurrency, for the simulator (`benchmarks.simulate`).

`FakeBatchedEngine` models one continuous-batching engine (or `num_engines` identical ones) with no
model and no HTTP. Each request draws a response length (tokens) from `lengths`; the engine runs at
most `max_running` requests per engine (the rest wait in its queue, FIFO); all running requests
decode in lock-step, one token each per *decode step*, and a decode step of an engine with r running
requests takes `per_token_s(r) = base_per_token_s + slope_per_token_s × r` (or a measured
`per_token_curve`, interpolated) — so per-request speed falls and engine throughput saturates as
concurrency grows, as on a real engine. Each request's start (`prefill_s`, or a measured `prefill_curve`
by requests at the engine: its prefill and its handling on the engine) holds up the engine's decoding
(they serialize); `request_latency_s` is latency outside the engine (HTTP, client).

Time: processor sharing, event driven. Every running request of an engine advances by the same
number of tokens, so one counter per engine (`work`: tokens each running request has decoded since
the engine started) and a heap of finish thresholds suffice. One timer (`loop.call_at`, no task) fires
at the next finish; arrivals, finishes, pauses and version stamps move the clock exactly. Pause
(retract, in_place) freezes decoding; `abort` returns every request with the tokens decoded so far.
Per-token versions: the version stamped when each token was decoded, as on the real engines.
Run it on virtual time (looptime): sleeps cost nothing.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_aio.inference.base import InferenceEngine, PauseMode
from miles_aio.scheduler.adaptive import EngineLoad
from miles_aio.types import GenerateOutput

__all__ = ["EmpiricalLengths", "FakeBatchedEngine", "LogNormalLengths"]

_Z99 = 2.3263478740408408


@dataclass(frozen=True, slots=True)
class LogNormalLengths:
    """Response lengths (tokens) with a given median and 99th percentile, at least 1."""

    p50: float
    p99: float

    @property
    def sigma(self) -> float:
        return math.log(max(self.p99, self.p50) / self.p50) / _Z99

    @property
    def mean(self) -> float:
        return self.p50 * math.exp(self.sigma**2 / 2)

    def __call__(self, rng: random.Random) -> int:
        return max(1, round(self.p50 * math.exp(self.sigma * rng.gauss(0.0, 1.0))))


@dataclass(frozen=True, slots=True)
class EmpiricalLengths:
    """Response lengths resampled from recorded ones (e.g. a run's trace or metrics)."""

    values: Sequence[int]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("no recorded lengths")

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    def __call__(self, rng: random.Random) -> int:
        return max(1, int(rng.choice(self.values)))


@dataclass(eq=False, slots=True)
class _Req:
    n: int  # tokens to produce
    fut: asyncio.Future[None]
    start: float = 0.0  # the engine's `work` when it started running
    running: bool = False
    done_tokens: int = 0  # set when it ends
    marks: list[tuple[int, int | None]] = field(default_factory=list)  # (from token, version)


class _Engine:
    """One engine's processor-sharing state (see the module docstring)."""

    def __init__(self) -> None:
        self.work = 0.0
        self.t = 0.0
        self.stall_until = 0.0  # decoding waits for the prefills started so far
        self.running: dict[int, _Req] = {}
        self.heap: list[tuple[float, int]] = []
        self.queue: collections.deque[tuple[int, _Req]] = collections.deque()

    def progress(self, req: _Req) -> int:
        return min(req.n, math.floor(self.work - req.start + 1e-9))


class FakeBatchedEngine(InferenceEngine):
    """A FAKE engine: continuous batching with concurrency-dependent decode speed (no model, no HTTP)."""

    def __init__(
        self,
        lengths: Callable[[random.Random], int],
        *,
        base_per_token_s: float = 0.02,
        slope_per_token_s: float = 0.0,
        max_running: int = 256,
        num_engines: int = 1,
        per_token_curve: Sequence[tuple[float, float]] = (),
        prefill_s: float = 0.0,
        prefill_curve: Sequence[tuple[float, float]] = (),
        request_latency_s: float = 0.0,
        vocab_size: int = 256,
        seed: int = 0,
    ) -> None:
        self._lengths = lengths
        self.base_per_token_s, self.slope_per_token_s = base_per_token_s, slope_per_token_s
        self._curve = sorted(per_token_curve)
        self.prefill_s, self.request_latency_s = prefill_s, request_latency_s
        self._prefill_curve = sorted(prefill_curve)
        if len(self._curve) == 1 or any(t <= 0 for _, t in self._curve):
            raise ValueError("a per-token curve needs >= 2 (running, seconds > 0) points")
        if any(t < 0 for _, t in self._prefill_curve):
            raise ValueError("a prefill curve needs (running, seconds >= 0) points")
        self.max_running = max_running
        self._vocab = vocab_size
        self._rng = random.Random(seed)
        self._engines = [_Engine() for _ in range(num_engines)]
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._paused: PauseMode | None = None
        self.version: int | None = None
        self.requests = 0
        self.max_in_flight = 0
        self.calls: list[str] = []

    # -- model ----------------------------------------------------------------------------------------
    def per_token_s(self, running: int) -> float:
        """Seconds of one decode step with `running` requests: base + slope × running, or, with a
        measured curve, piecewise-linear interpolation of its points (extrapolated past both ends)."""
        c = self._curve
        if not c:
            return self.base_per_token_s + self.slope_per_token_s * running
        i = next((k for k in range(1, len(c) - 1) if running < c[k][0]), len(c) - 1)
        (x0, y0), (x1, y1) = c[i - 1], c[i]
        return max(min(y for _, y in c) * 0.5, y0 + (y1 - y0) * (running - x0) / (x1 - x0))

    def start_s(self, running: int) -> float:
        """Engine seconds of one request start with `running` requests at the engine (running or queued,
        itself included):
        `prefill_s`, or, with a measured prefill curve, linear interpolation of its points (flat past
        both ends)."""
        c = self._prefill_curve
        if not c:
            return self.prefill_s
        if running <= c[0][0]:
            return c[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(c):
            if running <= x1:
                return y0 + (y1 - y0) * (running - x0) / (x1 - x0)
        return c[-1][1]

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=float(sum(len(e.running) for e in self._engines)),
            queued=float(sum(len(e.queue) for e in self._engines)),
        )

    def _advance(self, now: float) -> None:
        for e in self._engines:
            active_from = max(e.t, e.stall_until)
            if self._paused is None and e.running and now > active_from:
                e.work += (now - active_from) / self.per_token_s(len(e.running))
            e.t = now

    def _start_queued(self, e: _Engine, now: float) -> None:
        while e.queue and len(e.running) < self.max_running:
            rid, req = e.queue.popleft()
            if req.fut.done():
                continue
            req.start, req.running = e.work, True
            req.marks.append((0, self.version))
            e.running[rid] = req
            # its prefill holds up every decode step of the engine; its cost by the requests at the engine
            if cost := self.start_s(len(e.running) + len(e.queue)):
                e.stall_until = max(now, e.stall_until) + cost
            heapq.heappush(e.heap, (req.start + req.n, rid))

    def _finish(self, e: _Engine, rid: int) -> None:
        req = e.running.pop(rid)
        req.done_tokens = req.n
        if not req.fut.done():
            req.fut.set_result(None)

    def _settle(self) -> None:
        """Advance to now, finish what is due, start queued requests, set the one timer."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._advance(now)
        next_at = math.inf
        for e in self._engines:
            while e.heap and (e.heap[0][1] not in e.running or e.heap[0][0] <= e.work + 1e-9):
                _, rid = heapq.heappop(e.heap)
                if rid in e.running:
                    self._finish(e, rid)
            self._start_queued(e, now)
            while e.heap and e.heap[0][1] not in e.running:
                heapq.heappop(e.heap)
            if self._paused is None and e.heap:
                left = (e.heap[0][0] - e.work) * self.per_token_s(len(e.running))
                next_at = min(next_at, max(now, e.stall_until) + left)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if next_at < math.inf:
            self._timer = loop.call_at(max(next_at, now), self._settle)

    # -- InferenceEngine --------------------------------------------------------------------------------
    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        self.requests += 1
        if self.request_latency_s:  # HTTP and client work: latency that holds no engine time
            await asyncio.sleep(self.request_latency_s)
        natural = self._lengths(self._rng)
        n = max(1, min(natural, int(sampling_params.get("max_new_tokens", natural))))
        e = self._engines[next(self._rr) % len(self._engines)]
        req = _Req(n=n, fut=asyncio.get_running_loop().create_future())
        rid = next(self._ids)
        self._advance(asyncio.get_running_loop().time())
        e.queue.append((rid, req))
        self._settle()
        self.max_in_flight = max(
            self.max_in_flight, sum(len(x.running) + len(x.queue) for x in self._engines)
        )
        try:
            await req.fut
        finally:
            if not req.fut.done() or req.fut.cancelled():  # cancelled: leave the engine
                req.fut.cancel()
                e.running.pop(rid, None)
                self._settle()
        k = req.done_tokens
        finish = "abort" if k < n else ("length" if n < natural else "stop")
        versions: list[int | None] = []
        marks = [*req.marks, (k, None)]
        for (start, v), (end, _) in itertools.pairwise(marks):
            versions.extend([v] * (max(start, min(end, k)) - start))
        return GenerateOutput(
            text="",
            output_ids=[self._rng.randrange(self._vocab) for _ in range(k)],
            output_log_probs=[-1.0] * k,
            weight_versions=versions,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_tokens=len(input_ids),
        )

    async def pause_generation(self, mode: PauseMode) -> None:
        self.calls.append(f"pause:{mode}")
        self._advance(asyncio.get_running_loop().time())
        self._paused = mode
        if mode == "abort":
            for e in self._engines:
                for rid in list(e.running):
                    req = e.running.pop(rid)
                    req.done_tokens = e.progress(req)
                    req.fut.set_result(None)
                while e.queue:
                    _, req = e.queue.popleft()
                    if not req.fut.done():
                        req.fut.set_result(None)
        self._settle()

    async def continue_generation(self) -> None:
        self.calls.append("continue")
        self._advance(asyncio.get_running_loop().time())
        self._paused = None
        self._settle()

    async def flush_cache(self) -> None:
        self.calls.append("flush")

    async def update_weight_version(self, version: int) -> None:
        self.calls.append(f"version:{version}")
        self._advance(asyncio.get_running_loop().time())
        for e in self._engines:
            for req in e.running.values():
                req.marks.append((e.progress(req), version))
        self.version = version

    async def update_weights_from_disk(self, model_path: str, *, version: int) -> None:
        await self.update_weight_version(version)

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

"""Fakes at the engine and trainer seams, driven by time alone (run them on virtual time: looptime).

`FakeLatencyEngine` is the one FAKE engine (no model, no HTTP) of the virtual-time tests, the pipeline
benchmark and the simulator (`benchmarks.simulate`): continuous batching on a latency model. It stands
for one engine, or for `num_engines` identical ones (round robin). Each request draws its size on arrival
from one of two request models:

* `latency` (seconds; the scheduler tests' model): the request takes that many seconds of unpaused
  engine time, its round(latency × `tokens_per_s`) tokens appearing at a steady rate over them,
  whatever else runs;
* `lengths` (tokens; the simulator's model): the running requests of an engine decode in lock-step, one
  token each per decode step, and a step with r running takes `per_token_s(r)` = `base_per_token_s` +
  `slope_per_token_s` × r (or a measured `per_token_curve`): per-request speed falls and engine
  throughput saturates as concurrency grows, as on a real engine.

One time model runs both: an engine counts decode steps (a latency-model step is one second), a request
needs `work` steps (its length, or its latency) and yields its tokens evenly over them. At most
`max_running` requests per engine decode (default: no bound), the rest wait in its queue, FIFO. Each
request's start holds up the engine's decoding (`prefill_s`, or a measured `prefill_curve` by requests
at the engine: its prefill and handling); `request_latency_s` is latency outside the engine (HTTP,
client). Processor sharing, event driven: per engine, a step counter, a heap of finish thresholds and
one timer (`loop.call_at`, no task) at its next finish; arrivals, finishes, pauses and version stamps
move the clock exactly. An arrival or a finish touches its own engine only, so a request costs the same
CPU whether there is one engine or a thousand (`benchmarks.controller` runs 1,024).

Token ids are random draws (`vocab_size`) from the request model's random stream, one per token; with
`fast_ids=True` they are drawn in one C call per request from a stream of their own (the controller
benchmark's engines, where the per-token draw would cost more than the controller itself; the other
draws, response lengths or latencies, then differ from the default's for the same seed).

A pause (retract, in_place) stops decoding, and a paused engine holds new requests until continue, as
SGLang does; with `mode="abort"` a pause returns every request with the tokens decoded so far and
finish_reason "abort". Per-token versions: the version stamped when each token was decoded, as on the
real engines.

It also stands in for one engine behind the `EngineRouter` (the router's `client_factory`: `url`,
`health_generate`, `weight_version`, the broadcast calls), with faults a test injects: `fail(call, error)`
(the next `call` raises it), `slow(call, s)` (every `call` takes s seconds), `freeze()`/`thaw()` (every call
hangs and decoding stops, like a SIGSTOPped process), `kill()`/`revive()` (every call, in flight or new,
raises EngineUnavailable, like a dead server).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import heapq
import itertools
import json
import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_aio._durable import write_file_atomic
from miles_aio._notify import Notifier
from miles_aio.errors import EngineError, EngineUnavailable
from miles_aio.inference.base import InferenceEngine, PauseMode, SingleServerBroadcast
from miles_aio.scheduler.adaptive import EngineLoad
from miles_aio.types import GenerateOutput, Group

__all__ = [
    "EmpiricalLengths",
    "FakeLatencyEngine",
    "FakeTokenizer",
    "FakeTrainer",
    "LogNormal",
    "LogNormalLatency",
]

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile
_EPS = 1e-9  # decode steps: sums of float step counts are not exact
SETTLE_CHUNK = 64
"""Engines settled per loop pass by a pause or a continue (`FakeLatencyEngine._stop_or_go_paced`)."""


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A long-tailed quantity (request seconds, response tokens) with median `p50` and 99th percentile
    `p99` (p99/p50 >= 10 is typical of RL; a p99 below p50 means no spread)."""

    p50: float
    p99: float

    @property
    def sigma(self) -> float:
        return math.log(max(self.p99, self.p50) / self.p50) / _Z99

    @property
    def mean(self) -> float:
        return self.p50 * math.exp(self.sigma**2 / 2)

    def __call__(self, rng: random.Random) -> float:
        return self.p50 * math.exp(self.sigma * rng.gauss(0.0, 1.0))


LogNormalLatency = LogNormal
"""`LogNormal`, by the name the scheduler tests draw request latencies (seconds) with."""


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
    work: float  # decode steps they take
    fut: asyncio.Future[None]
    ids: list[int] | None = None  # drawn on arrival (latency model) or when it ends (lengths model)
    start: float = 0.0  # the engine's step count when it started running
    done_tokens: int = 0  # set when it ends
    marks: list[tuple[int, int | None]] = field(default_factory=list)  # (from token, version)


class _Engine:
    """One engine's processor-sharing state (see the module docstring)."""

    def __init__(self) -> None:
        self.steps = 0.0  # decode steps each running request has made since the engine started
        self.t = 0.0
        self.stall_until = 0.0  # decoding waits for the request starts (prefills) so far
        self.running: dict[int, _Req] = {}
        self.heap: list[tuple[float, int]] = []  # (finish threshold in steps, request id)
        self.queue: collections.deque[tuple[int, _Req]] = collections.deque()
        self.timer: asyncio.TimerHandle | None = None  # at its next finish
        # (step count, version) at each version stamp since its oldest running request started: a
        # request's marks are read from these when it leaves (`close_marks`), not appended to every
        # running request at every stamp (50,000 of them, 50-70 ms of the controller's loop per push)
        self.stamps: list[tuple[float, int | None]] = []

    def progress(self, req: _Req, steps: float | None = None) -> int:
        """Tokens `req` has decoded so far (or had, when the engine's step count was `steps`)."""
        made = (self.steps if steps is None else steps) - req.start
        if made + _EPS >= req.work:
            return req.n
        return min(req.n, math.floor(made * (req.n / req.work) + _EPS))

    def stamp(self, version: int | None) -> None:
        """Tokens decoded from now on carry `version`; stamps older than every running request go."""
        if not self.running:  # a request that starts later takes the version in force then
            self.stamps.clear()
            return
        oldest = next(iter(self.running.values())).start  # running is in start order: steps only grow
        if self.stamps and self.stamps[0][0] < oldest:
            del self.stamps[: bisect.bisect_left(self.stamps, oldest, key=lambda st: st[0])]
        self.stamps.append((self.steps, version))

    def close_marks(self, req: _Req) -> None:
        """`req` leaves the engine: the stamps made while it ran become its marks."""
        first = bisect.bisect_left(self.stamps, req.start, key=lambda st: st[0])
        req.marks.extend((self.progress(req, steps), v) for steps, v in self.stamps[first:])


def _now() -> float | None:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # no loop: nothing can be in flight
        return None


class FakeLatencyEngine(InferenceEngine):
    """A FAKE engine: continuous batching on a latency model, no model, no HTTP (module docstring).

    Give one request model: `latency` (a draw of seconds; tokens at `tokens_per_s`) or `lengths` (a draw
    of tokens; decode steps of `per_token_s(running)`)."""

    def __init__(
        self,
        latency: Callable[[random.Random], float] | None = None,
        *,
        tokens_per_s: float = 100.0,
        lengths: Callable[[random.Random], float] | None = None,
        base_per_token_s: float = 0.02,
        slope_per_token_s: float = 0.0,
        per_token_curve: Sequence[tuple[float, float]] = (),
        max_running: int | None = None,
        num_engines: int = 1,
        prefill_s: float = 0.0,
        prefill_curve: Sequence[tuple[float, float]] = (),
        request_latency_s: float = 0.0,
        vocab_size: int = 256,
        seed: int = 0,
        url: str = "fake://engine",
        fast_ids: bool = False,
    ) -> None:
        if (latency is None) == (lengths is None):
            raise ValueError("give one request model: latency (seconds) or lengths (tokens)")
        self.url = url
        self._latency, self._lengths = latency, lengths
        self._tokens_per_s = tokens_per_s
        self.base_per_token_s, self.slope_per_token_s = base_per_token_s, slope_per_token_s
        self._curve = sorted(per_token_curve)
        self.prefill_s, self.request_latency_s = prefill_s, request_latency_s
        self._prefill_curve = sorted(prefill_curve)
        if len(self._curve) == 1 or any(t <= 0 for _, t in self._curve):
            raise ValueError("a per-token curve needs >= 2 (running, seconds > 0) points")
        if any(t < 0 for _, t in self._prefill_curve):
            raise ValueError("a prefill curve needs (running, seconds >= 0) points")
        self.max_running = max_running
        self._cap = math.inf if max_running is None else max_running
        self._vocab = vocab_size
        self._rng = random.Random(seed)
        self._id_rng = random.Random(seed + 1) if fast_ids else None
        self._fold = bytes(b % vocab_size for b in range(256)) if vocab_size <= 256 else b""
        self._engines = [_Engine() for _ in range(num_engines)]
        self._live = 0  # requests at the engines (decoding or queued): `in_flight`, kept without a sum
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._paused: PauseMode | None = None
        self._changed = Notifier()
        self.version: int | None = None
        self.max_in_flight = 0
        self.requests = 0
        self.calls: list[str] = []  # admin calls, in order
        self.continuations = 0  # the router's stats read it (partial rollout is the real client's)
        self.frozen = False
        self.dead = False
        self.model_path: str | None = None
        self._faults: dict[str, list[EngineError]] = {}
        self._slow: dict[str, float] = {}

    # -- the time model ---------------------------------------------------------------------------------
    def per_token_s(self, running: int) -> float:
        """Seconds of one decode step of the lengths model with `running` requests: base + slope ×
        running, or, with a measured curve, piecewise-linear interpolation of its points (extrapolated
        past both ends)."""
        c = self._curve
        if not c:
            return self.base_per_token_s + self.slope_per_token_s * running
        i = next((k for k in range(1, len(c) - 1) if running < c[k][0]), len(c) - 1)
        (x0, y0), (x1, y1) = c[i - 1], c[i]
        return max(min(y for _, y in c) * 0.5, y0 + (y1 - y0) * (running - x0) / (x1 - x0))

    def _step_s(self, running: int) -> float:
        return 1.0 if self._latency is not None else self.per_token_s(running)

    def start_s(self, running: int) -> float:
        """Engine seconds of one request start with `running` requests at the engine (running or queued,
        itself included): `prefill_s`, or, with a measured prefill curve, linear interpolation of its
        points (flat past both ends)."""
        c = self._prefill_curve
        if not c:
            return self.prefill_s
        if running <= c[0][0]:
            return c[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(c):
            if running <= x1:
                return y0 + (y1 - y0) * (running - x0) / (x1 - x0)
        return c[-1][1]

    @property
    def in_flight(self) -> int:
        """Requests at the engines: decoding (or stopped by a pause or freeze) and queued."""
        return sum(len(e.running) + len(e.queue) for e in self._engines)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=float(sum(len(e.running) for e in self._engines)),
            queued=float(sum(len(e.queue) for e in self._engines)),
        )

    def _new_request(self, sampling_params: Mapping[str, Any], fut: asyncio.Future[None]) -> tuple[_Req, int]:
        """The request drawn from the request model, and its natural length (before max_new_tokens)."""
        if self._latency is not None:
            work = max(0.0, self._latency(self._rng))
            natural = max(1, round(work * self._tokens_per_s))
            n = min(natural, int(sampling_params.get("max_new_tokens", natural)))
            ids = self._draw_ids(n)
            return _Req(n=n, work=work * n / natural, fut=fut, ids=ids), natural
        assert self._lengths is not None
        natural = max(1, round(self._lengths(self._rng)))
        n = max(1, min(natural, int(sampling_params.get("max_new_tokens", natural))))
        return _Req(n=n, work=float(n), fut=fut), natural

    def _draw_ids(self, k: int) -> list[int]:
        """`k` random token ids (see the module docstring: one draw per token, or one C call)."""
        if self._id_rng is None:
            return [self._rng.randrange(self._vocab) for _ in range(k)]
        if self._vocab <= 256:  # bytes, folded onto the vocabulary by a translation table: all in C
            return list(self._id_rng.randbytes(k).translate(self._fold))
        return [v % self._vocab for v in memoryview(self._id_rng.randbytes(4 * k)).cast("I")]

    def _advance(self, now: float) -> None:
        """Every engine's clock to `now` (before a change that concerns them all: pause, stamp)."""
        for e in self._engines:
            self._advance_engine(e, now)

    def _advance_engine(self, e: _Engine, now: float) -> None:
        """One engine's decode steps up to `now`: between two of its events it decodes at a fixed rate
        (its running set and stall change only at its own events), so advancing it alone is exact."""
        active_from = max(e.t, e.stall_until)
        if not (self._paused is not None or self.frozen) and e.running and now > active_from:
            e.steps += (now - active_from) / self._step_s(len(e.running))
        e.t = now

    def _recount(self) -> None:
        self._live = sum(len(e.running) + len(e.queue) for e in self._engines)

    def _start_queued(self, e: _Engine, now: float) -> None:
        while e.queue and len(e.running) < self._cap:
            rid, req = e.queue.popleft()
            if req.fut.done():
                continue
            req.start = e.steps
            req.marks.append((0, self.version))
            e.running[rid] = req
            # its prefill holds up every decode step of the engine; its cost by the requests at the engine
            if cost := self.start_s(len(e.running) + len(e.queue)):
                e.stall_until = max(now, e.stall_until) + cost
            heapq.heappush(e.heap, (req.start + req.work, rid))

    def _finish(self, e: _Engine, rid: int) -> None:
        req = e.running.pop(rid)
        e.close_marks(req)
        req.done_tokens = req.n
        if not req.fut.done():
            req.fut.set_result(None)

    def _settle(self) -> None:
        """Settle every engine (after a change that concerns them all)."""
        for e in self._engines:
            self._settle_engine(e)

    def _settle_engine(self, e: _Engine) -> None:
        """Advance one engine to now, finish what is due, start queued requests, set its timer."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._advance_engine(e, now)
        before = len(e.running) + len(e.queue)
        while e.heap and (e.heap[0][1] not in e.running or e.heap[0][0] <= e.steps + _EPS):
            _, rid = heapq.heappop(e.heap)
            if rid in e.running:
                self._finish(e, rid)
        self._start_queued(e, now)
        while e.heap and e.heap[0][1] not in e.running:
            heapq.heappop(e.heap)
        self._live += len(e.running) + len(e.queue) - before
        if not (self._paused is not None or self.frozen) and e.heap:
            left = (e.heap[0][0] - e.steps) * self._step_s(len(e.running))
            due = max(max(now, e.stall_until) + left, now)
            if e.timer is not None and e.timer.when() <= due:
                # the next finish moved later (an arrival slows every decode step): the timer set
                # before fires early and settles again, instead of a cancel and a new timer at every
                # one of thousands of arrivals per second (`benchmarks.controller`'s lag case)
                return
            if e.timer is not None:
                e.timer.cancel()
            e.timer = loop.call_at(due, self._on_timer, e)
        elif e.timer is not None:
            e.timer.cancel()
            e.timer = None

    def _on_timer(self, e: _Engine) -> None:
        e.timer = None  # it has fired
        self._settle_engine(e)

    def _cancel_timers(self) -> None:
        for e in self._engines:
            if e.timer is not None:
                e.timer.cancel()
                e.timer = None

    def _stamp(self, version: int) -> None:
        """Tokens decoded from now on carry `version`."""
        if (now := _now()) is not None:
            self._advance(now)
        for e in self._engines:
            e.stamp(version)
        self.version = version

    def _stop_or_go(self, change: Callable[[], None]) -> None:
        """Apply a change to whether the engines decode, with the clock moved to it."""
        now = _now()
        if now is not None:
            self._advance(now)
        change()
        self._changed.notify()
        if now is not None:
            self._settle()

    async def _stop_or_go_paced(self, change: Callable[[], None]) -> None:
        """`_stop_or_go` for an engine call (pause, continue): the engines are settled `SETTLE_CHUNK` at
        a time with the loop let run between chunks, as N real engines answer N calls over several loop
        passes. Settling 1,000 engines' 50,000 requests in one callback held the controller's loop for
        12–16 ms at every push (`benchmarks.controller`'s lag case). Exact all the same: every clock is
        moved to the change first, settling is idempotent (an engine's own timer may settle it between
        two chunks), and an engine settled later is credited the decode time since the change."""
        now = _now()
        if now is None or len(self._engines) <= SETTLE_CHUNK:
            self._stop_or_go(change)
            return
        self._advance(now)
        change()
        self._changed.notify()
        settled = 0
        try:
            while settled < len(self._engines):
                if settled:
                    await asyncio.sleep(0)
                for e in self._engines[settled : settled + SETTLE_CHUNK]:
                    self._settle_engine(e)
                settled += SETTLE_CHUNK
        finally:
            # cancelled between two chunks (a push's deadline, a stop): the change stands, so the rest
            # are settled now, or a continue would leave their requests with no timer for ever
            for e in self._engines[settled:]:
                self._settle_engine(e)

    # -- faults ----------------------------------------------------------------------------------------
    def fail(self, call: str, error: EngineError, *, times: int = 1) -> None:
        """The next `times` calls of `call` (a method name) raise `error`."""
        self._faults.setdefault(call, []).extend([error] * times)

    def slow(self, call: str, seconds: float) -> None:
        """Every `call` takes `seconds` before it answers."""
        self._slow[call] = seconds

    def freeze(self) -> None:
        """Like SIGSTOP: every call hangs (decoding stops) until `thaw()`."""
        self._stop_or_go(lambda: setattr(self, "frozen", True))

    def thaw(self) -> None:
        self._stop_or_go(lambda: setattr(self, "frozen", False))

    def kill(self) -> None:
        """Like a dead server: every call, in flight or new, raises EngineUnavailable until `revive()`,
        which brings it back with no weights (version None), as a restarted server."""
        self.dead = True
        for e in self._engines:
            for req in [*e.running.values(), *(r for _, r in e.queue)]:
                if not req.fut.done():
                    req.fut.set_exception(self._refused())
            e.running.clear()
            e.heap.clear()
            e.queue.clear()
            e.stamps.clear()
        self._live = 0
        self._changed.notify()
        self._cancel_timers()

    def revive(self) -> None:
        def back() -> None:
            self.dead, self.frozen, self._paused, self.version = False, False, None, None

        self._stop_or_go(back)

    def _refused(self) -> EngineUnavailable:
        return EngineUnavailable(f"{self.url}: connection refused (fake engine is dead)")

    def _check_alive(self) -> None:
        if self.dead:
            raise self._refused()

    async def _admin(self, call: str) -> None:
        """The common prelude of every non-generate call: hang while frozen, fail as scripted."""
        self._check_alive()
        await self._changed.wait_until(lambda: not self.frozen or self.dead)
        self._check_alive()
        if delay := self._slow.get(call):
            await asyncio.sleep(delay)
        if faults := self._faults.get(call):
            raise faults.pop(0)

    # -- InferenceEngine --------------------------------------------------------------------------------
    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        self._check_alive()
        self.requests += 1
        if self.request_latency_s:  # HTTP and client work: latency that holds no engine time
            await asyncio.sleep(self.request_latency_s)
            self._check_alive()
        loop = asyncio.get_running_loop()
        req, natural = self._new_request(sampling_params, loop.create_future())
        e = self._engines[next(self._rr) % len(self._engines)]
        rid = next(self._ids)
        self._advance_engine(e, loop.time())
        e.queue.append((rid, req))
        self._live += 1
        self._settle_engine(e)
        self.max_in_flight = max(self.max_in_flight, self._live)
        try:
            await req.fut
        finally:
            if not req.fut.done() or req.fut.cancelled():  # cancelled: leave the engine
                req.fut.cancel()
                if e.running.pop(rid, None) is not None:
                    self._live -= 1
                self._settle_engine(e)
        k = req.done_tokens
        finish = "abort" if k < req.n else ("length" if req.n < natural else "stop")
        versions: list[int | None] = []
        for (start, v), (end, _) in itertools.pairwise([*req.marks, (k, None)]):
            versions.extend([v] * (max(start, min(end, k)) - start))
        ids = req.ids[:k] if req.ids is not None else self._draw_ids(k)
        return GenerateOutput(
            text="",
            output_ids=ids,
            output_log_probs=[-1.0] * k,
            weight_versions=versions,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_tokens=len(input_ids),
        )

    async def pause_generation(self, mode: PauseMode) -> None:
        await self._admin("pause_generation")
        self.calls.append(f"pause:{mode}")

        def pause() -> None:
            self._paused = mode
            if mode != "abort":
                return
            for e in self._engines:
                for rid in list(e.running):
                    req = e.running.pop(rid)
                    e.close_marks(req)
                    req.done_tokens = e.progress(req)
                    req.fut.set_result(None)
                while e.queue:
                    _, req = e.queue.popleft()
                    if not req.fut.done():
                        req.fut.set_result(None)
            self._recount()

        await self._stop_or_go_paced(pause)

    async def continue_generation(self) -> None:
        await self._admin("continue_generation")
        self.calls.append("continue")
        await self._stop_or_go_paced(lambda: setattr(self, "_paused", None))

    async def flush_cache(self) -> None:
        await self._admin("flush_cache")
        self.calls.append("flush")

    async def update_weight_version(self, version: int) -> None:
        await self._admin("update_weight_version")
        self.calls.append(f"version:{version}")
        self._stamp(version)

    async def update_weights_from_disk(
        self, model_path: str, *, version: int, flush_cache: bool = True
    ) -> None:
        await self._admin("update_weights_from_disk")
        self.calls.append(f"load:{model_path}")
        self.model_path = model_path
        self._stamp(version)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        await self._admin("init_weights_update_group")
        self.calls.append(f"group:{group_name}:{rank_offset}/{world_size}")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._admin("destroy_weights_update_group")
        self.calls.append(f"destroy:{group_name}")

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        last_bucket: bool = True,
    ) -> None:
        await self._admin("update_weights_from_distributed")
        self.calls.append(f"broadcast:{group_name}")
        if version is not None:
            self._stamp(version)

    def weight_broadcast(self) -> SingleServerBroadcast:
        return SingleServerBroadcast(self)

    async def health_generate(self) -> None:
        await self._admin("health_generate")

    async def weight_version(self) -> int | None:
        await self._admin("weight_version")
        return self.version

    async def server_info(self) -> dict[str, Any]:
        await self._admin("server_info")
        load = self.load()
        return {
            "internal_states": [{"num_running_reqs": int(load.running), "num_waiting_reqs": int(load.queued)}]
        }

    async def aclose(self) -> None:
        self._cancel_timers()


class FakeTrainer:
    """A FAKE trainer: each step takes `step_time_s` (+ `per_token_s` per response token)."""

    def __init__(
        self,
        *,
        step_time_s: float = 1.0,
        per_token_s: float = 0.0,
        sync_time_s: float = 0.0,
        keep_batches: bool = True,
        stages: bool = False,
    ) -> None:
        self.step_time_s = step_time_s
        self.stages = stages  # True: pushes run alongside the next step's training, as disk pushes do
        self.per_token_s = per_token_s
        self.sync_time_s = sync_time_s
        self.keep_batches = keep_batches  # tests inspect what was trained; long runs must not hoard it
        self.steps: list[tuple[int, list[Group]]] = []
        self.synced_versions: list[int] = []
        self.loaded_step: int | None = None

    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        tokens = sum(s.response_length for g in batch for s in g)
        await asyncio.sleep(self.step_time_s + self.per_token_s * tokens)
        self.steps.append((step, batch if self.keep_batches else []))
        return {"train/loss": 1.0 / (1 + step), "train/tokens": float(tokens)}

    async def stage_weights(self, *, version: int) -> bool:
        return self.stages

    async def sync_weights(self, engine: InferenceEngine, *, version: int) -> None:
        await asyncio.sleep(self.sync_time_s)
        self.synced_versions.append(version)

    async def save(self, step: int, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - a fake: tiny, test-only write
        write_file_atomic(directory / "fake_trainer.json", json.dumps({"step": step}).encode())  # fsynced

    async def load(self, directory: Path) -> None:
        self.loaded_step = json.loads((directory / "fake_trainer.json").read_text())["step"]

    async def aclose(self) -> None:
        return None


class FakeTokenizer:
    """A FAKE byte tokenizer (one id per UTF-8 byte) for runs that need no real model."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t % 256 for t in token_ids).decode("utf-8", errors="replace")

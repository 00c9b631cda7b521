"""`EngineRouter`: one `InferenceEngine` over N SGLang-API servers (one `SGLangClient` each).

    async with EngineRouter.open(["http://a:30000", "http://b:30000"], partial_rollout=True) as router:
        out = await router.generate(input_ids=ids, sampling_params=params, routing_key=group_index)

* **Balancing**: a request goes to the healthy engine with the fewest requests in flight (ties: fewest
  requests so far). **Stickiness**: a `routing_key` seen before goes back to the same engine while it
  stays healthy, so the turns of a multi-turn rollout reuse its prefix cache (an LRU of
  `RouterPolicy.sticky_keys` keys).
* **Health**: an engine that fails a call with `EngineUnavailable` (refused/reset connection, timeout,
  HTTP 5xx) is marked unhealthy and gets no more requests. The health checker (`run_health_checks`, a
  task in `open()`'s TaskGroup) probes unhealthy engines with `/health_generate` every
  `RouterPolicy.health_check_interval_s` and brings them back; before that it re-applies the last
  `update_weights_from_disk` if the engine reports a different version (a restarted server).
* **Retries**: a generate that fails with `EngineUnavailable` is retried on another engine, at most
  `RouterPolicy.max_retries` times, with exponential backoff. `EngineBadResponse` is not retried: the
  engine answered, and its answer broke the contract; retrying would hide the bug. When no engine is
  healthy, generate waits (on a condition, not polling) for one to come back, up to
  `RouterPolicy.unavailable_deadline_s`, then raises `EngineUnavailable`.
* **Admin calls** (pause/continue/flush/update_*) go to every engine concurrently and raise if any fails,
  after all have answered (one failure does not cancel the others mid-call).
* **One sglang-router URL** works too: it is then a single engine here, and the router in front of the
  servers balances; `routing_key` still reaches it as the `X-SMG-Routing-Key` header (its consistent-hash
  policy keeps keys sticky). Admin calls then reach only what that router forwards to its workers.

Without `open()` (plain constructor plus `aclose()`) nothing brings unhealthy engines back unless the
caller runs `run_health_checks()` in its own TaskGroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, final

import structlog

from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable
from miles_aio.inference.base import PauseMode
from miles_aio.inference.client import ClientTimeouts, SGLangClient
from miles_aio.types import GenerateOutput

__all__ = ["HEALTH_CHECK_INTERVAL_S", "EngineRouter", "RouterPolicy"]

_log = structlog.get_logger(__name__)

HEALTH_CHECK_INTERVAL_S: Final = 1.0
"""Default pause between probes of unhealthy engines (the one deliberate interval: nothing else can tell
us that a dead server came back). While every engine is healthy the checker sleeps on a condition."""
LATENCY_WINDOW: Final = 4096
"""Latency samples kept per engine for p50/p99."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterPolicy:
    """How the router retries, waits and remembers."""

    max_retries: int = 2
    """A generate that failed with EngineUnavailable is retried on another engine at most this often."""
    retry_backoff_s: float = 0.05
    """Pause before the first retry; doubled for each further one."""
    retry_backoff_max_s: float = 2.0
    """Cap on the pause between retries."""
    unavailable_deadline_s: float = 300.0
    """How long a generate waits for some engine to be healthy before raising EngineUnavailable."""
    health_check_interval_s: float = HEALTH_CHECK_INTERVAL_S
    """Pause between rounds of probes of unhealthy engines."""
    sticky_keys: int = 100_000
    """Routing keys remembered (least recently used forgotten first)."""

    def __post_init__(self) -> None:
        if min(self.max_retries, self.retry_backoff_s, self.unavailable_deadline_s, self.sticky_keys) < 0:
            raise ValueError(f"RouterPolicy values must be >= 0: {self}")
        if not self.health_check_interval_s > 0 or self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError(f"RouterPolicy needs health_check_interval_s > 0, backoff max >= base: {self}")


@dataclass(slots=True)
class _Engine:
    """One server behind the router, with the counters the metrics report."""

    index: int
    client: SGLangClient
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    retries: int = 0
    """Requests that failed here and were retried on an engine."""
    last_error: str = ""
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))


def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


@final
class EngineRouter:
    """`InferenceEngine` over several SGLang servers; see the module docstring. Use `EngineRouter.open()`."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        partial_rollout: bool = False,
        policy: RouterPolicy | None = None,
        timeouts: ClientTimeouts | None = None,
        max_connections: int = 2048,
    ) -> None:
        if not urls:
            raise ValueError("EngineRouter needs at least one engine URL")
        self.policy: Final = policy or RouterPolicy()
        timeouts = timeouts or ClientTimeouts()
        self._engines: Final = tuple(
            _Engine(
                i,
                SGLangClient(
                    url,
                    api_key=api_key,
                    timeouts=timeouts,
                    partial_rollout=partial_rollout,
                    max_connections=max_connections,
                ),
            )
            for i, url in enumerate(urls)
        )
        self._sticky: OrderedDict[Hashable, int] = OrderedDict()
        self._changed = asyncio.Condition()
        """Notified when an engine changes health and on close; generate and the health checker wait on it."""
        self._closing = False
        self._retries = 0
        self._version: int | None = None
        """The last policy version stamped through this router (None before the first push)."""
        self._disk_weights: tuple[str, int] | None = None
        """(model_path, version) of the last update_weights_from_disk: replayed on engines that rejoin."""

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        partial_rollout: bool = False,
        policy: RouterPolicy | None = None,
        timeouts: ClientTimeouts | None = None,
        max_connections: int = 2048,
    ) -> AsyncIterator[EngineRouter]:
        """Build a router, run its health checker in a TaskGroup for the block, and close it afterwards."""
        router = cls(
            urls,
            api_key=api_key,
            partial_rollout=partial_rollout,
            policy=policy,
            timeouts=timeouts,
            max_connections=max_connections,
        )
        body_error: Exception | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(router.run_health_checks(), name="engine-router-health")
                try:
                    yield router
                except Exception as e:  # re-raised below as itself, not wrapped in the group's ExceptionGroup
                    body_error = e
                finally:
                    await router._stop()
            if body_error is not None:
                raise body_error
        finally:
            await router.aclose()

    @property
    def clients(self) -> tuple[SGLangClient, ...]:
        """The per-engine clients, for calls that differ per engine."""
        return tuple(e.client for e in self._engines)

    async def _stop(self) -> None:
        async with self._changed:
            self._closing = True
            self._changed.notify_all()

    async def aclose(self) -> None:
        """Stop the health checker, wake waiting generates (they raise EngineUnavailable), close clients."""
        await self._stop()
        async with asyncio.TaskGroup() as tg:
            for e in self._engines:
                tg.create_task(e.client.aclose(), name=f"engine-close-{e.index}")

    # ---- routing -------------------------------------------------------------------------------------

    def _pick(self, routing_key: Hashable | None, avoid: set[int]) -> _Engine | None:
        """The engine for this request: the key's sticky engine if healthy, else the least loaded."""
        healthy = [e for e in self._engines if e.healthy]
        candidates = [e for e in healthy if e.index not in avoid] or healthy
        if not candidates:
            return None
        sticky = None if routing_key is None else self._sticky.get(routing_key)
        if sticky is not None and self._engines[sticky] in candidates:
            self._sticky.move_to_end(routing_key)
            return self._engines[sticky]
        best = min(candidates, key=lambda e: (e.in_flight, e.requests))
        if routing_key is not None:
            self._sticky[routing_key] = best.index
            self._sticky.move_to_end(routing_key)
            if len(self._sticky) > self.policy.sticky_keys:
                self._sticky.popitem(last=False)
        return best

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        """One generation on the chosen engine, retried elsewhere on `EngineUnavailable`.

        Waits for: a healthy engine when none is (unblocked by the health checker or aclose, bounded by
        `unavailable_deadline_s`); the backoff between attempts; the engine's answer.
        """
        deadline = asyncio.get_running_loop().time() + self.policy.unavailable_deadline_s
        failures = 0
        tried: set[int] = set()
        while True:
            if self._closing:
                raise EngineUnavailable("EngineRouter is closed")
            engine = self._pick(routing_key, tried)
            if engine is None:
                await self._wait_for_healthy(deadline)
                continue
            engine.in_flight += 1
            engine.requests += 1
            t0 = time.monotonic()
            try:
                out = await engine.client.generate(
                    input_ids=input_ids, sampling_params=sampling_params, routing_key=routing_key
                )
            except EngineUnavailable as e:
                engine.failures += 1
                await self._mark_unhealthy(engine, e)
                failures += 1
                if failures > self.policy.max_retries:
                    raise EngineUnavailable(f"generate failed {failures} times, giving up; last: {e}") from e
                engine.retries += 1
                self._retries += 1
                tried.add(engine.index)
                p = self.policy
                await asyncio.sleep(min(p.retry_backoff_max_s, p.retry_backoff_s * 2 ** (failures - 1)))
                continue
            except EngineBadResponse:
                engine.failures += 1
                raise
            finally:
                engine.in_flight -= 1
            engine.latencies_s.append(time.monotonic() - t0)
            out.meta["engine_index"] = engine.index  # which engine served it (the timeline's engine track)
            return out

    async def _wait_for_healthy(self, deadline: float) -> None:
        """Wait until some engine is healthy (or the router closes), at most until `deadline`."""
        try:
            async with asyncio.timeout_at(deadline), self._changed:
                await self._changed.wait_for(lambda: self._closing or any(e.healthy for e in self._engines))
        except TimeoutError as e:
            errors = "; ".join(f"{x.client.url}: {x.last_error}" for x in self._engines)
            waited, n = self.policy.unavailable_deadline_s, len(self._engines)
            raise EngineUnavailable(f"no healthy engine for {waited:.1f}s among {n}: {errors}") from e

    async def wait_for_healthy(self, n: int | None = None) -> None:
        """Wait until at least `n` engines (default: all) are healthy; unblocked by the health checker, or
        by aclose (then it raises EngineUnavailable). Bound it with `asyncio.timeout` if need be."""
        want = len(self._engines) if n is None else n
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._closing or sum(e.healthy for e in self._engines) >= want
            )
        if self._closing:
            raise EngineUnavailable("EngineRouter is closed")

    async def _mark_unhealthy(self, engine: _Engine, error: EngineError) -> None:
        engine.last_error = str(error)
        if engine.healthy:
            engine.healthy = False
            _log.warning("engine_unhealthy", url=engine.client.url, error=str(error))
            async with self._changed:
                self._changed.notify_all()

    # ---- health --------------------------------------------------------------------------------------

    async def run_health_checks(self) -> None:
        """The health checker loop; returns when the router closes.

        Consumes engines marked unhealthy. While all are healthy it waits on the condition (woken by a
        failure or aclose); otherwise it probes every unhealthy engine concurrently, then sleeps
        `health_check_interval_s` (cut short by aclose) before the next round.
        """
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._closing or not self._all_healthy())
            if self._closing:
                return
            async with asyncio.TaskGroup() as tg:
                for e in self._engines:
                    if not e.healthy:
                        tg.create_task(self._probe(e), name=f"engine-health-probe-{e.index}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.policy.health_check_interval_s), self._changed:
                    await self._changed.wait_for(lambda: self._closing)

    def _all_healthy(self) -> bool:
        return all(e.healthy for e in self._engines)

    async def _probe(self, engine: _Engine) -> None:
        """One health probe: `/health_generate`, then weights resync; on success the engine rejoins."""
        try:
            await engine.client.health_generate()
            await self._resync(engine)
        except EngineError as e:
            engine.last_error = str(e)
            _log.debug("engine_still_unhealthy", url=engine.client.url, error=str(e))
            return
        engine.healthy = True
        _log.info("engine_rejoined", url=engine.client.url)
        async with self._changed:
            self._changed.notify_all()

    async def _resync(self, engine: _Engine) -> None:
        """Bring a rejoining engine to the router's policy version if it lost it (e.g. it restarted)."""
        if self._version is None or await engine.client.weight_version() == self._version:
            return
        if self._disk_weights is not None and self._disk_weights[1] == self._version:
            path, version = self._disk_weights
            _log.info("engine_resync_weights", url=engine.client.url, model_path=path, version=version)
            await engine.client.update_weights_from_disk(path, version=version)
        else:
            _log.warning("engine_rejoined_stale", url=engine.client.url, expected_version=self._version)

    # ---- admin: every engine -------------------------------------------------------------------------

    async def _broadcast(self, what: str, call: Callable[[SGLangClient], Awaitable[None]]) -> None:
        """Run `call` on every engine concurrently; after all finish, raise if any failed."""
        errors: dict[str, EngineError] = {}

        async def one(engine: _Engine) -> None:
            try:
                await call(engine.client)
            except EngineError as e:
                errors[engine.client.url] = e
                if isinstance(e, EngineUnavailable):
                    await self._mark_unhealthy(engine, e)

        async with asyncio.TaskGroup() as tg:
            for e in self._engines:
                tg.create_task(one(e), name=f"engine-{what}-{e.index}")
        if errors:
            down = all(isinstance(e, EngineUnavailable) for e in errors.values())
            kind = EngineUnavailable if down else EngineError
            detail = "; ".join(f"{url}: {e}" for url, e in errors.items())
            raise kind(f"{what} failed on {len(errors)}/{len(self._engines)} engines: {detail}")

    async def pause_generation(self, mode: PauseMode) -> None:
        await self._broadcast("pause_generation", lambda c: c.pause_generation(mode))

    async def continue_generation(self) -> None:
        await self._broadcast("continue_generation", lambda c: c.continue_generation())

    async def flush_cache(self) -> None:
        await self._broadcast("flush_cache", lambda c: c.flush_cache())

    async def update_weight_version(self, version: int) -> None:
        """Stamp `version` on every engine (never aborting in-flight requests)."""
        self._version = version
        await self._broadcast("update_weight_version", lambda c: c.update_weight_version(version))

    async def update_weights_from_disk(self, model_path: str, *, version: int) -> None:
        """Every engine loads `model_path` as `version`; remembered for engines that rejoin later."""
        self._version, self._disk_weights = version, (model_path, version)
        # flush_cache=False: the controller owns the flush (before the transfer, while paused). Under
        # in_place it must not flush at all: SGLang refuses while frozen requests hold KV and then fails
        # the whole update call.
        await self._broadcast(
            "update_weights_from_disk",
            lambda c: c.update_weights_from_disk(model_path, version=version, flush_cache=False),
        )

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offsets: Sequence[int],
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Every engine joins the trainer's broadcast group; `rank_offsets[i]` is engine i's first rank."""
        if len(rank_offsets) != len(self._engines):
            raise ValueError(f"{len(rank_offsets)} rank_offsets for {len(self._engines)} engines")
        offsets = {e.client.url: off for e, off in zip(self._engines, rank_offsets, strict=True)}
        await self._broadcast(
            "init_weights_update_group",
            lambda c: c.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=offsets[c.url],
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            ),
        )

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
    ) -> None:
        """Every engine receives the broadcast tensors (all must take part for the collective to finish)."""
        if version is not None:
            self._version, self._disk_weights = version, None
        await self._broadcast(
            "update_weights_from_distributed",
            lambda c: c.update_weights_from_distributed(
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                version=version,
                group_name=group_name,
                flush_cache=False,  # as in update_weights_from_disk
            ),
        )

    async def health_generate(self) -> None:
        """`/health_generate` on every engine; raises if any fails."""
        await self._broadcast("health_generate", lambda c: c.health_generate())

    # ---- metrics -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters since start: per engine (`router/engine<i>/...`) and totals; latency p50/p99 in seconds
        over the last `LATENCY_WINDOW` successful requests per engine (absent until there is one)."""
        out: dict[str, float] = {
            "router/engines": float(len(self._engines)),
            "router/engines_healthy": float(sum(e.healthy for e in self._engines)),
            "router/in_flight": float(sum(e.in_flight for e in self._engines)),
            "router/requests": float(sum(e.requests for e in self._engines)),
            "router/failures": float(sum(e.failures for e in self._engines)),
            "router/retries": float(self._retries),
            "router/partial_rollout_continuations": float(sum(e.client.continuations for e in self._engines)),
        }
        every: list[float] = []
        for e in self._engines:
            p = f"router/engine{e.index}"
            out |= {
                f"{p}/healthy": float(e.healthy),
                f"{p}/in_flight": float(e.in_flight),
                f"{p}/requests": float(e.requests),
                f"{p}/failures": float(e.failures),
                f"{p}/retries": float(e.retries),
            }
            if e.latencies_s:
                out[f"{p}/latency_p50_s"] = _percentile(e.latencies_s, 0.5)
                out[f"{p}/latency_p99_s"] = _percentile(e.latencies_s, 0.99)
                every.extend(e.latencies_s)
        if every:
            out["router/latency_p50_s"] = _percentile(every, 0.5)
            out["router/latency_p99_s"] = _percentile(every, 0.99)
        return out

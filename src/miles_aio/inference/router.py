"""`EngineRouter`: one `InferenceEngine` over N SGLang-API servers (one `SGLangClient` each).

    async with EngineRouter.open(["http://a:30000", "http://b:30000"], partial_rollout=True) as router:
        out = await router.generate(input_ids=ids, sampling_params=params, routing_key=group_index)

Each engine is in one `availability.EngineState` (ACTIVE, STANDBY, OUT, RESTARTING, LOST); only ACTIVE
engines take requests.

* **Balancing**: a request goes to the ACTIVE engine with the fewest requests in flight (ties: fewest
  requests so far). **Stickiness**: a `routing_key` seen before goes back to the same engine while it
  stays ACTIVE, so the turns of a multi-turn rollout reuse its prefix cache (an LRU of
  `RouterPolicy.sticky_keys` keys).
* **Retries**: a generate that fails with `EngineUnavailable` (refused/reset connection, timeout, HTTP
  5xx) marks that engine OUT and is retried on another engine, at most `RouterPolicy.max_retries` times,
  with exponential backoff. `EngineBadResponse` is not retried: the engine answered, and its answer broke
  the contract; retrying would hide the bug. When no engine is ACTIVE, generate waits (on a notifier, not
  polling) for one to come back, up to `RouterPolicy.unavailable_deadline_s`, then raises
  `EngineUnavailable`. `generate_stream` (tokens handed out as they are produced) routes and waits the
  same way, and retries only until its first chunk reached the consumer.
* **Weight pushes** (pause → flush → load → stamp → continue, driven by the controller): `pause_generation`
  starts a push over the ACTIVE and STANDBY engines (`availability.push_members`); every call of the push
  goes to the members concurrently, each bounded by `RouterPolicy.admin_timeout_s`
  (`--engine-admin-timeout-s`). A member that fails a call or misses the deadline is **excluded**: OUT,
  one `engine_excluded` log line, counted (`router/exclusions`, `perf/engine/excluded`), its in-flight
  generate calls aborted (they raise `EngineUnavailable`, not retried: the rollout pool makes the sample
  ABORTED and its group goes to the unused handler), and the rest of the push goes on without it; a push
  never fails because of an engine. A flush refused with 400 (requests still draining) is asked again
  first, bounded (`RouterPolicy.flush_attempts`, with backoff), as miles does.
  `continue_generation` ends the push: its members are ACTIVE.
  Admin calls outside a push go to the ACTIVE engines with the same rule.
* **Rejoining**: one health task per engine (`engine-health-<i>`) probes an OUT engine, after any push in
  progress: `/continue_generation` (an engine excluded mid-push may still be paused) and
  `/health_generate`, both bounded by the admin deadline; then `availability.rejoin_action`: it serves
  the current version → ACTIVE; the last `update_weights_from_disk` is the current version → it loads
  it first; otherwise (weights came by broadcast) → STANDBY until the next push brings them. A failed probe
  is retried every `RouterPolicy.health_check_interval_s` (the one deliberate interval: nothing else can
  tell us that a dead server came back).
* **Restarts** are not the router's: the supervisor of launched engines (`inference.supervisor`) calls
  `engine_died(i)` (RESTARTING), then `replace_engine(i, new_url)` (a new client, OUT: probed and
  re-synced as above) or `engine_lost(i)` (LOST).
* **No engine left**: the fleet task (`engine-fleet`) raises `EngineUnavailable` with the reason
  (`availability.fleet_failure`) when every engine is LOST, or none has been ACTIVE or STANDBY (none
  restarting) for `unavailable_deadline_s`; in `open()` that fails the block.
* **One sglang-router URL** works too: it is then a single engine here, and the router in front of the
  servers balances; `routing_key` still reaches it as the `X-SMG-Routing-Key` header (its consistent-hash
  policy keeps keys sticky). Admin calls then reach only what that router forwards to its workers.

Without `open()` (plain constructor plus `aclose()`) nothing probes OUT engines and nothing watches the
fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, final

import structlog

from miles_aio._durable import fault_point
from miles_aio._notify import Notifier
from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable, primary_error
from miles_aio.inference.availability import (
    EngineState,
    Rejoin,
    fleet_failure,
    push_members,
    rejoin_action,
)
from miles_aio.inference.base import (
    ChunkSink,
    GenerateChunk,
    PauseMode,
    WeightGroupMember,
    generate_streamed,
)
from miles_aio.inference.client import ClientTimeouts, FlushRefused, SGLangClient
from miles_aio.types import GenerateOutput

__all__ = ["ADMIN_TIMEOUT_S", "HEALTH_CHECK_INTERVAL_S", "EngineClient", "EngineRouter", "RouterPolicy"]

_log = structlog.get_logger(__name__)

HEALTH_CHECK_INTERVAL_S: Final = 1.0
"""Default pause between probes of an OUT engine."""
ADMIN_TIMEOUT_S: Final = 60.0
"""Default deadline of each engine's answer to a call of a weight push (`--engine-admin-timeout-s`)."""
LATENCY_WINDOW: Final = 4096
"""Latency samples kept per engine for p50/p99."""


class EngineClient(Protocol):
    """What the router needs of one engine's handle (`SGLangClient`; the fakes in `miles_aio.testing`)."""

    @property
    def url(self) -> str: ...

    @property
    def continuations(self) -> int: ...

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput: ...

    async def pause_generation(self, mode: PauseMode) -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def update_weight_version(self, version: int) -> None: ...

    async def update_weights_from_disk(
        self, model_path: str, *, version: int, flush_cache: bool = True
    ) -> None: ...

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None: ...

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
    ) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def health_generate(self) -> None: ...

    async def weight_version(self) -> int | None: ...

    async def server_info(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


ClientFactory = Callable[[str], EngineClient]


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterPolicy:
    """How the router retries, waits, excludes and remembers."""

    max_retries: int = 2
    """A generate that failed with EngineUnavailable is retried on another engine at most this often."""
    retry_backoff_s: float = 0.05
    """Pause before the first retry; doubled for each further one."""
    retry_backoff_max_s: float = 2.0
    """Cap on the pause between retries."""
    unavailable_deadline_s: float = 300.0
    """How long a generate waits for an ACTIVE engine before raising EngineUnavailable; also how long the
    fleet may have no usable engine (none restarting) before the run fails."""
    health_check_interval_s: float = HEALTH_CHECK_INTERVAL_S
    """Pause between probes of an OUT engine."""
    admin_timeout_s: float = ADMIN_TIMEOUT_S
    """Deadline of each engine's answer to an admin call (and to a probe's continue and health calls); an
    engine that misses it is excluded."""
    sticky_keys: int = 100_000
    """Routing keys remembered (least recently used forgotten first)."""
    flush_attempts: int = 6
    """`/flush_cache` tries per engine while it answers 400 (SGLang refuses to flush while requests are
    running or queued, e.g. aborted ones still draining after a pause; miles retries too). Then the
    engine is excluded, with the reason. All tries together stay within `admin_timeout_s`."""
    flush_backoff_s: float = 0.25
    """Pause before the second flush try; doubled for each further one, capped at `retry_backoff_max_s`
    (defaults: 0.25 + 0.5 + 1 + 2 + 2 s between 6 tries)."""

    def __post_init__(self) -> None:
        if min(self.max_retries, self.retry_backoff_s, self.unavailable_deadline_s, self.sticky_keys) < 0:
            raise ValueError(f"RouterPolicy values must be >= 0: {self}")
        if not self.health_check_interval_s > 0 or self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError(f"RouterPolicy needs health_check_interval_s > 0, backoff max >= base: {self}")
        if not self.admin_timeout_s > 0:
            raise ValueError(f"RouterPolicy needs admin_timeout_s > 0: {self}")
        if self.flush_attempts < 1 or self.flush_backoff_s < 0:
            raise ValueError(f"RouterPolicy needs flush_attempts >= 1, flush_backoff_s >= 0: {self}")


@dataclass(eq=False, slots=True)
class _Engine:
    """One server behind the router, with the counters the metrics report."""

    index: int
    client: EngineClient
    state: EngineState = EngineState.ACTIVE
    epoch: int = 0
    """Bumped every time the engine leaves the push set: a broadcast group formed before is stale."""
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    retries: int = 0
    """Requests that failed here and were retried on an engine."""
    exclusions: int = 0
    restarts: int = 0
    last_error: str = ""
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks inside a generate on this engine (aborted when it is excluded)."""
    aborting: set[asyncio.Task[Any]] = field(default_factory=set)
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    @property
    def usable(self) -> bool:
        return self.state in (EngineState.ACTIVE, EngineState.STANDBY)


@dataclass(slots=True)
class _Push:
    members: set[int]
    synced: bool = False
    """A weight transfer ran in this push: STANDBY members have the current weights after it."""


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
        batch_generate: bool = False,
        policy: RouterPolicy | None = None,
        timeouts: ClientTimeouts | None = None,
        max_connections: int = 2048,
        client_factory: ClientFactory | None = None,
    ) -> None:
        if not urls:
            raise ValueError("EngineRouter needs at least one engine URL")
        self.policy: Final = policy or RouterPolicy()
        self._new_client: ClientFactory = client_factory or functools.partial(
            SGLangClient,
            api_key=api_key,
            timeouts=timeouts or ClientTimeouts(),
            partial_rollout=partial_rollout,
            batch_generate=batch_generate,
            max_connections=max_connections,
        )
        self._engines: Final = tuple(_Engine(i, self._new_client(url)) for i, url in enumerate(urls))
        self._sticky: OrderedDict[Hashable, int] = OrderedDict()
        self._changed = Notifier()
        """Notified on every state change, push start/end and close; every waiter here waits on it."""
        self._closing = False
        self._retries = 0
        self._exclusions = 0
        self._push: _Push | None = None
        self._unusable_since: float | None = None
        """Loop time since which no engine is ACTIVE or STANDBY (None: some engine is)."""
        self._version: int | None = None
        """The last policy version stamped through this router (None before the first push)."""
        self._disk_weights: tuple[str, int] | None = None
        """(model_path, version) of the last update_weights_from_disk: loaded by engines that rejoin."""

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        partial_rollout: bool = False,
        batch_generate: bool = False,
        policy: RouterPolicy | None = None,
        timeouts: ClientTimeouts | None = None,
        max_connections: int = 2048,
        client_factory: ClientFactory | None = None,
    ) -> AsyncIterator[EngineRouter]:
        """Build a router, run its health and fleet tasks in a TaskGroup for the block, close it afterwards.
        A fleet failure (no engine left) cancels the block and is raised as itself."""
        router = cls(
            urls,
            api_key=api_key,
            partial_rollout=partial_rollout,
            batch_generate=batch_generate,
            policy=policy,
            timeouts=timeouts,
            max_connections=max_connections,
            client_factory=client_factory,
        )
        body_error: Exception | None = None
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    for e in router._engines:
                        tg.create_task(router._health_loop(e), name=f"engine-health-{e.index}")
                    tg.create_task(router._watch_fleet(), name="engine-fleet")
                    try:
                        yield router
                    except Exception as e:  # re-raised below as itself, not wrapped in an ExceptionGroup
                        body_error = e
                    finally:
                        router._stop()
            except BaseExceptionGroup as eg:
                raise primary_error(eg)  # noqa: B904 - the fleet's reason, with its own cause chain
            if body_error is not None:
                raise body_error
        finally:
            await router.aclose()

    @property
    def clients(self) -> tuple[EngineClient, ...]:
        """The per-engine clients (every engine, whatever its state), for calls that differ per engine."""
        return tuple(e.client for e in self._engines)

    @property
    def states(self) -> tuple[EngineState, ...]:
        return tuple(e.state for e in self._engines)

    def push_clients(self) -> tuple[EngineClient, ...]:
        """The clients a weight transfer goes to now: the push's members (outside a push: ACTIVE engines)."""
        return tuple(e.client for e in self._targets())

    def membership_key(self) -> tuple[tuple[int, int], ...]:
        """Identifies the set of engines `push_clients()` names: it changes whenever an engine leaves or
        joins the set (a broadcast group formed for another key is stale). One (index, epoch) per client."""
        return tuple((e.index, e.epoch) for e in self._targets())

    def weight_broadcast(self) -> EngineRouter:
        """The router is its own `WeightBroadcast`: a push goes to its members (`push_clients()`)."""
        return self

    def _stop(self) -> None:
        self._closing = True
        self._changed.notify()

    async def aclose(self) -> None:
        """Stop the health tasks, wake waiting generates (they raise EngineUnavailable), close clients."""
        self._stop()
        async with asyncio.TaskGroup() as tg:
            for e in self._engines:
                tg.create_task(e.client.aclose(), name=f"engine-close-{e.index}")

    # ---- states --------------------------------------------------------------------------------------

    def _set_state(self, engine: _Engine, state: EngineState) -> None:
        if engine.state is state:
            return
        if engine.usable and state not in (EngineState.ACTIVE, EngineState.STANDBY):
            engine.epoch += 1
            if self._push is not None:
                self._push.members.discard(engine.index)
        engine.state = state
        usable = any(e.usable for e in self._engines)
        if not usable and self._unusable_since is None:
            self._unusable_since = asyncio.get_running_loop().time()
        elif usable:
            self._unusable_since = None
        self._changed.notify()

    def _mark_unhealthy(self, engine: _Engine, error: EngineError) -> None:
        """A generate failed with EngineUnavailable: out of rotation until a probe brings it back."""
        engine.last_error = str(error)
        if engine.usable:
            _log.warning("engine_unhealthy", url=engine.client.url, error=str(error))
            self._set_state(engine, EngineState.OUT)

    def _exclude(self, engine: _Engine, what: str, error: str) -> None:
        """A member failed (or missed the deadline of) an admin call: OUT, counted, its requests aborted."""
        engine.last_error = f"{what}: {error}"
        if not engine.usable:
            return
        engine.exclusions += 1
        self._exclusions += 1
        _log.warning(
            "engine_excluded",
            url=engine.client.url,
            call=what,
            error=error,
            aborted_requests=len(engine.calls),
            version=self._version,
        )
        self._set_state(engine, EngineState.OUT)
        for task in engine.calls:
            if task not in engine.aborting:
                engine.aborting.add(task)
                task.cancel()

    def engine_died(self, index: int, reason: str) -> None:
        """Its process exited (the supervisor saw it): RESTARTING until `replace_engine` or `engine_lost`."""
        engine = self._engines[index]
        engine.last_error = reason
        if engine.state is not EngineState.LOST:
            self._set_state(engine, EngineState.RESTARTING)

    async def replace_engine(self, index: int, url: str) -> None:
        """A restarted engine serves at `url` now: a new client, OUT (probed, re-synced, then it rejoins)."""
        engine = self._engines[index]
        old, engine.client = engine.client, self._new_client(url)
        engine.restarts += 1
        self._set_state(engine, EngineState.OUT)
        self._changed.notify()  # its health task drops the old client's backoff
        await old.aclose()

    def engine_lost(self, index: int, reason: str) -> None:
        """Restarts spent: it never comes back."""
        engine = self._engines[index]
        engine.last_error = reason
        self._set_state(engine, EngineState.LOST)

    # ---- routing -------------------------------------------------------------------------------------

    def _pick(self, routing_key: Hashable | None, avoid: set[int]) -> _Engine | None:
        """The engine for this request: the key's sticky engine if ACTIVE, else the least loaded."""
        healthy = [e for e in self._engines if e.state is EngineState.ACTIVE]
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

        Waits for: an ACTIVE engine when none is (unblocked by a rejoin or aclose, bounded by
        `unavailable_deadline_s`); the backoff between attempts; the engine's answer. If the engine is
        excluded meanwhile the call is aborted: `EngineUnavailable`, not retried.
        """
        return await self._routed(
            routing_key,
            lambda client: client.generate(
                input_ids=input_ids, sampling_params=sampling_params, routing_key=routing_key
            ),
        )

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        """`generate`, streamed (`base.StreamingEngine`): the same engine choice, waits and exclusion; an
        `EngineUnavailable` is retried elsewhere only while no chunk has reached `on_chunk` (after that
        the consumer holds tokens of this attempt: it raises). A client that cannot stream generates, and
        its output is one chunk."""
        delivered = False

        async def sink(chunk: GenerateChunk) -> None:
            nonlocal delivered
            delivered = True
            await on_chunk(chunk)

        return await self._routed(
            routing_key,
            lambda client: generate_streamed(
                client,
                input_ids=input_ids,
                sampling_params=sampling_params,
                on_chunk=sink,
                routing_key=routing_key,
            ),
            retryable=lambda: not delivered,
        )

    async def _routed(
        self,
        routing_key: Hashable | None,
        call: Callable[[EngineClient], Awaitable[GenerateOutput]],
        retryable: Callable[[], bool] = lambda: True,
    ) -> GenerateOutput:
        """`call` on the engine `_pick` chooses, with the waits, retries and exclusion of `generate`; an
        EngineUnavailable is retried only while `retryable()` is true."""
        deadline = asyncio.get_running_loop().time() + self.policy.unavailable_deadline_s
        failures = 0
        tried: set[int] = set()
        task = asyncio.current_task()
        while True:
            if self._closing:
                raise EngineUnavailable("EngineRouter is closed")
            engine = self._pick(routing_key, tried)
            if engine is None:
                await self._wait_for_active(deadline)
                continue
            engine.in_flight += 1
            engine.requests += 1
            if task is not None:
                engine.calls.add(task)
            t0 = time.monotonic()
            try:
                out = await call(engine.client)
            except asyncio.CancelledError:
                if task is not None and task in engine.aborting and task.uncancel() == 0:
                    raise EngineUnavailable(
                        f"{engine.client.url}: request aborted, the engine was excluded ({engine.last_error})"
                    ) from None
                raise
            except EngineUnavailable as e:
                engine.failures += 1
                self._mark_unhealthy(engine, e)
                failures += 1
                if not retryable():
                    raise EngineUnavailable(f"failed after streaming tokens, not retried: {e}") from e
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
                engine.calls.discard(task)
                engine.aborting.discard(task)
            engine.latencies_s.append(time.monotonic() - t0)
            out.meta["engine_index"] = engine.index  # which engine served it (the timeline's engine track)
            return out

    async def _wait_for_active(self, deadline: float) -> None:
        """Wait until some engine is ACTIVE (or the router closes), at most until `deadline`."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._changed.wait_until(
                    lambda: self._closing or any(e.state is EngineState.ACTIVE for e in self._engines)
                )
        except TimeoutError as e:
            errors = "; ".join(f"{x.client.url}: {x.state.value}: {x.last_error}" for x in self._engines)
            waited, n = self.policy.unavailable_deadline_s, len(self._engines)
            raise EngineUnavailable(f"no healthy engine for {waited:.1f}s among {n}: {errors}") from e

    async def wait_for_healthy(self, n: int | None = None) -> None:
        """Wait until at least `n` engines (default: all) are ACTIVE; unblocked by a rejoin, or by aclose
        (then it raises EngineUnavailable). Bound it with `asyncio.timeout` if need be."""
        want = len(self._engines) if n is None else n
        await self._changed.wait_until(
            lambda: self._closing or sum(e.state is EngineState.ACTIVE for e in self._engines) >= want
        )
        if self._closing:
            raise EngineUnavailable("EngineRouter is closed")

    # ---- health and fleet ----------------------------------------------------------------------------

    async def _health_loop(self, engine: _Engine) -> None:
        """Probe `engine` whenever it is OUT, every `health_check_interval_s` until it rejoins; returns when
        the router closes."""
        while True:
            await self._changed.wait_until(lambda: self._closing or engine.state is EngineState.OUT)
            if self._closing:
                return
            client = engine.client
            if await self._probe(engine, client):
                continue

            def replaced(client: EngineClient = client) -> bool:
                return self._closing or engine.client is not client

            with contextlib.suppress(TimeoutError):  # cut short by a new client (a restart) or close
                async with asyncio.timeout(self.policy.health_check_interval_s):
                    await self._changed.wait_until(replaced)

    async def _probe(self, engine: _Engine, client: EngineClient) -> bool:
        """One probe of an OUT engine; True if it rejoined (or is no longer OUT with this client)."""

        def still_mine() -> bool:
            return engine.client is client and engine.state is EngineState.OUT and not self._closing

        try:
            while True:
                await self._changed.wait_until(lambda: self._push is None or not still_mine())
                if not still_mine():
                    return True
                async with asyncio.timeout(self.policy.admin_timeout_s):
                    await client.continue_generation()  # excluded mid-push: it may still be paused
                    await client.health_generate()
                    reported = await client.weight_version()
                version, disk = self._version, self._disk_weights
                action = rejoin_action(current=version, engine=reported, on_disk=disk and disk[1])
                if action is Rejoin.RESYNC:
                    assert disk is not None and version is not None
                    _log.info("engine_resync_weights", url=client.url, model_path=disk[0], version=version)
                    await client.update_weights_from_disk(disk[0], version=version, flush_cache=False)
                    continue  # a push may have run meanwhile: decide again
                if not still_mine() or self._push is not None or self._version != version:
                    continue
                self._set_state(
                    engine, EngineState.ACTIVE if action is Rejoin.ACTIVE else EngineState.STANDBY
                )
                _log.info("engine_rejoined", url=client.url, state=engine.state.value, version=version)
                return True
        except (EngineError, TimeoutError) as e:
            engine.last_error = f"probe: {e or 'timed out'}"
            _log.debug("engine_still_unhealthy", url=client.url, error=engine.last_error)
            return False

    async def _watch_fleet(self) -> None:
        """Raise `EngineUnavailable` once no engine is left (`availability.fleet_failure`); returns when the
        router closes. Waits on the notifier; while no engine is usable, also for the deadline."""
        loop, deadline = asyncio.get_running_loop(), self.policy.unavailable_deadline_s
        while True:
            await self._changed.wait_until(lambda: self._closing or self._unusable_since is not None)
            if self._closing:
                return
            since = self._unusable_since
            unusable_for = None if since is None else loop.time() - since
            reason = fleet_failure(self.states, unavailable_for_s=unusable_for, deadline_s=deadline)
            if reason is not None:
                detail = "; ".join(f"{e.client.url}: {e.state.value}: {e.last_error}" for e in self._engines)
                _log.error("engine_fleet_failed", reason=reason, engines=detail)
                raise EngineUnavailable(f"{reason} ({detail})")
            restarting = any(e.state is EngineState.RESTARTING for e in self._engines)
            wait_s = None if restarting or unusable_for is None else max(0.0, deadline - unusable_for)

            def changed(states: tuple[EngineState, ...] = self.states) -> bool:
                return self._closing or self.states != states

            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._changed.wait_until(changed)

    # ---- admin: the push's members -------------------------------------------------------------------

    def _targets(self) -> list[_Engine]:
        if self._push is not None:
            return [e for e in self._engines if e.index in self._push.members]
        return [e for e in self._engines if e.state is EngineState.ACTIVE]

    async def _on_members(
        self,
        what: str,
        call: Callable[[EngineClient], Awaitable[None]],
        targets: Sequence[_Engine] | None = None,
    ) -> None:
        """Run `call` on every target engine concurrently, each within the admin deadline; a target that
        fails or misses it is excluded (the others go on, none is cancelled by another's failure)."""
        timeout_s = self.policy.admin_timeout_s

        async def one(engine: _Engine) -> None:
            try:
                async with asyncio.timeout(timeout_s):
                    await call(engine.client)
            except TimeoutError:
                self._exclude(engine, what, f"no answer within {timeout_s:g}s (--engine-admin-timeout-s)")
            except EngineError as e:
                self._exclude(engine, what, str(e))

        async with asyncio.TaskGroup() as tg:
            for e in self._targets() if targets is None else targets:
                tg.create_task(one(e), name=f"engine-{what}-{e.index}")

    async def pause_generation(self, mode: PauseMode) -> None:
        """Start a push over the ACTIVE and STANDBY engines, and pause them."""
        self._push = _Push(members=set(push_members(self.states)))
        self._changed.notify()
        await self._on_members("pause_generation", lambda c: c.pause_generation(mode))

    async def continue_generation(self) -> None:
        """Continue the push's members and end the push: they are ACTIVE (STANDBY ones only if weights were
        transferred in it)."""
        await self._on_members("continue_generation", lambda c: c.continue_generation())
        push, self._push = self._push, None
        if push is not None:
            for e in self._engines:
                if e.index in push.members and e.state is EngineState.STANDBY and push.synced:
                    _log.info("engine_rejoined", url=e.client.url, state="active", version=self._version)
                if e.index in push.members and (e.state is EngineState.ACTIVE or push.synced):
                    self._set_state(e, EngineState.ACTIVE)
        self._changed.notify()

    async def flush_cache(self) -> None:
        """`/flush_cache` on the members. One that refuses (400: requests still running or queued) is
        asked again, `RouterPolicy.flush_attempts` times in all with backoff; one still refusing then, or
        failing otherwise, is excluded with the reason."""
        await self._on_members("flush_cache", self._flush_retrying)

    async def _flush_retrying(self, client: EngineClient) -> None:
        p, loop = self.policy, asyncio.get_running_loop()
        t0 = loop.time()
        for attempt in range(1, p.flush_attempts + 1):
            try:
                await client.flush_cache()
                return
            except FlushRefused as e:
                if attempt == p.flush_attempts:
                    raise FlushRefused(
                        f"{client.url}: /flush_cache still refused after {attempt} tries over "
                        f"{loop.time() - t0:.1f}s, giving up (the engine flushes only once no request runs "
                        "or waits in its queue; a retract pause keeps retracted requests queued until "
                        f"continue, miles #1497); last answer: {e}"
                    ) from e
                delay = min(p.retry_backoff_max_s, p.flush_backoff_s * 2 ** (attempt - 1))
                _log.info(
                    "flush_cache_refused", url=client.url, attempt=attempt, retry_in_s=delay, error=str(e)
                )
                await asyncio.sleep(delay)

    async def update_weight_version(self, version: int) -> None:
        """Stamp `version` on the members (never aborting in-flight requests)."""
        self._version = version
        await self._on_members("update_weight_version", lambda c: c.update_weight_version(version))

    async def update_weights_from_disk(self, model_path: str, *, version: int) -> None:
        """The members load `model_path` as `version`; remembered for engines that rejoin later."""
        fault_point("push:weights_written")  # rank 0 wrote them; no engine has loaded them yet
        self._version, self._disk_weights = version, (model_path, version)
        if self._push is not None:
            self._push.synced = True
        # flush_cache=False: the controller owns the flush (before the transfer, while paused). Under
        # in_place it must not flush at all: SGLang refuses while frozen requests hold KV and then fails
        # the whole update call.
        await self._on_members(
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
        clients: Sequence[WeightGroupMember] | None = None,
    ) -> None:
        """The engines of `clients` (default: `push_clients()`) join the trainer's broadcast group;
        `rank_offsets[i]` is the first rank of `clients[i]`. One excluded meanwhile is skipped (the group
        then cannot form: the trainer's side times out)."""
        clients = self.push_clients() if clients is None else tuple(clients)
        if len(rank_offsets) != len(clients):
            raise ValueError(f"{len(rank_offsets)} rank_offsets for {len(clients)} engines")
        offsets = {id(c): off for c, off in zip(clients, rank_offsets, strict=True)}
        targets = [e for e in self._targets() if id(e.client) in offsets]
        await self._on_members(
            "init_weights_update_group",
            lambda c: c.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=offsets[id(c)],
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            ),
            targets,
        )

    async def destroy_weights_update_group(
        self, group_name: str, *, clients: Sequence[WeightGroupMember] | None = None
    ) -> None:
        """The engines of `clients` (default: `push_clients()`) leave broadcast group `group_name` (formed
        for an older membership: only its members have it)."""
        ids = {id(c) for c in (self.push_clients() if clients is None else clients)}
        await self._on_members(
            "destroy_weights_update_group",
            lambda c: c.destroy_weights_update_group(group_name),
            [e for e in self._targets() if id(e.client) in ids],
        )

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        last_bucket: bool = True,
    ) -> None:
        """The members receive the broadcast tensors (all must take part for the collective to finish)."""
        fault_point("push:broadcast")  # rank 0 sends this bucket meanwhile: the kill is mid-collective
        if version is not None:
            self._version, self._disk_weights = version, None
        if self._push is not None:
            self._push.synced = True
        await self._on_members(
            "update_weights_from_distributed",
            lambda c: c.update_weights_from_distributed(
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                version=version,
                group_name=group_name,
                flush_cache=False,  # as in update_weights_from_disk
                last_bucket=last_bucket,
            ),
        )

    async def health_generate(self) -> None:
        """`/health_generate` on the ACTIVE engines; one that fails is excluded."""
        await self._on_members("health_generate", lambda c: c.health_generate())

    async def probe_stalled(self) -> None:
        """The run waits and nothing completes: `/health_generate` on the ACTIVE engines, as
        `health_generate`, unless a push is in progress (its engines are paused on purpose, and the push
        has its own deadline). Without it a frozen engine would only be found at the next push, and with
        an empty buffer no step comes to push: the only engine frozen would hang the run."""
        if self._push is None:
            await self.health_generate()

    # ---- metrics -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters since start: per engine (`router/engine<i>/...`) and totals; latency p50/p99 in seconds
        over the last `LATENCY_WINDOW` successful requests per engine (absent until there is one)."""
        active = [e.state is EngineState.ACTIVE for e in self._engines]
        out: dict[str, float] = {
            "router/engines": float(len(self._engines)),
            "router/engines_healthy": float(sum(active)),
            "router/engines_lost": float(sum(e.state is EngineState.LOST for e in self._engines)),
            "router/in_flight": float(sum(e.in_flight for e in self._engines)),
            "router/requests": float(sum(e.requests for e in self._engines)),
            "router/failures": float(sum(e.failures for e in self._engines)),
            "router/retries": float(self._retries),
            "router/exclusions": float(self._exclusions),
            "router/restarts": float(sum(e.restarts for e in self._engines)),
            "router/partial_rollout_continuations": float(sum(e.client.continuations for e in self._engines)),
        }
        every: list[float] = []
        for e, ok in zip(self._engines, active, strict=True):
            p = f"router/engine{e.index}"
            out |= {
                f"{p}/healthy": float(ok),
                f"{p}/in_flight": float(e.in_flight),
                f"{p}/requests": float(e.requests),
                f"{p}/failures": float(e.failures),
                f"{p}/retries": float(e.retries),
                f"{p}/exclusions": float(e.exclusions),
                f"{p}/restarts": float(e.restarts),
            }
            if e.latencies_s:
                out[f"{p}/latency_p50_s"] = _percentile(e.latencies_s, 0.5)
                out[f"{p}/latency_p99_s"] = _percentile(e.latencies_s, 0.99)
                every.extend(e.latencies_s)
        if every:
            out["router/latency_p50_s"] = _percentile(every, 0.5)
            out["router/latency_p99_s"] = _percentile(every, 0.99)
        return out

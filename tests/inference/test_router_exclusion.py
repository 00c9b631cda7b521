"""The router's exclusion, rejoin and restart logic on virtual time (looptime), with the fake engine at the
client seam (`EngineRouter(client_factory=...)`): a push goes on without an engine that fails or hangs,
that engine's requests are aborted and it gets no new ones, it rejoins only with the current weights, a
restarted engine is swapped in at its new URL, and the fleet fails only when no engine is left."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from miles_aio.errors import EngineBadResponse, EngineUnavailable
from miles_aio.inference.availability import EngineState, RestartPolicy
from miles_aio.inference.router import EngineRouter, RouterPolicy
from miles_aio.inference.supervisor import supervise_engines
from miles_aio.testing import FakeLatencyEngine
from miles_aio.types import GenerateOutput

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]
POLICY = RouterPolicy(
    health_check_interval_s=1.0, admin_timeout_s=5.0, unavailable_deadline_s=100.0, retry_backoff_s=0.01
)
PARAMS = {"max_new_tokens": 10}
A, B = EngineState.ACTIVE, EngineState.OUT


def fakes(n: int) -> dict[str, FakeLatencyEngine]:
    """n fake engines, each request 1 s of (unpaused) virtual time, 10 tokens."""
    return {
        f"fake://{i}": FakeLatencyEngine(lambda rng: 1.0, tokens_per_s=10.0, url=f"fake://{i}", seed=i)
        for i in range(n)
    }


@contextlib.asynccontextmanager
async def router_over(
    engines: dict[str, FakeLatencyEngine], policy: RouterPolicy = POLICY, urls: list[str] | None = None
) -> AsyncIterator[EngineRouter]:
    async with EngineRouter.open(
        urls or list(engines), client_factory=engines.__getitem__, policy=policy
    ) as router:
        yield router


async def push(router: EngineRouter, version: int, *, load: bool = True) -> float:
    """The controller's push (retract mode), by disk; returns its virtual duration."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await router.pause_generation("retract")
    await router.flush_cache()
    if load:
        await router.update_weights_from_disk(f"/w/v{version}", version=version)
    await router.update_weight_version(version)
    await router.continue_generation()
    return loop.time() - t0


async def outcome(router: EngineRouter, key: int) -> GenerateOutput | EngineUnavailable:
    try:
        return await router.generate(input_ids=[1], sampling_params=PARAMS, routing_key=key)
    except EngineUnavailable as e:
        return e


def test_a_push_excludes_an_engine_that_fails_a_call_and_aborts_its_requests(vrun: Any) -> None:
    engines = fakes(2)
    a, b = engines.values()

    async def main() -> None:
        async with router_over(engines) as router, asyncio.TaskGroup() as tg:
            await push(router, 1)
            b.fail("flush_cache", EngineBadResponse("fake://1/flush_cache: HTTP 400: not flushed"))
            requests = [tg.create_task(outcome(router, k)) for k in range(8)]
            await asyncio.sleep(0.5)
            on_b = b.in_flight
            assert on_b > 0 and a.in_flight > 0
            n = len(b.calls)
            took = await push(router, 2)
            assert took < 0.1  # nobody waited: the failing engine was dropped at once
            assert router.states == (A, B)
            assert b.calls[n:] == ["pause:retract"]  # the rest of the push went on without it
            await asyncio.sleep(0.01)  # the aborted requests end at once; a's still run (0.5 s left)
            aborted = [r.result() for r in requests if r.done()]
            assert len(aborted) == on_b  # exactly its in-flight requests, not retried elsewhere
            assert all(isinstance(e, EngineUnavailable) and "excluded" in str(e) for e in aborted)
            assert a.version == 2 and a.calls[-1] == "continue"
            stats = router.stats()
            assert stats["router/exclusions"] == 1 and stats["router/engine1/exclusions"] == 1
            # it answers again: probed after the push, loaded the current weights, then rejoined
            async with asyncio.timeout(5):
                await router.wait_for_healthy()
            assert b.version == 2 and b.model_path == "/w/v2"
            assert b.calls[n + 1 :].index("continue") < b.calls[n + 1 :].index("load:/w/v2")  # un-paused too
            before = b.requests
            await asyncio.gather(*(outcome(router, 100 + k) for k in range(6)))
            assert b.requests > before  # back in rotation

    vrun(main())


def test_a_frozen_engine_holds_a_push_for_the_deadline_only_and_gets_no_requests(vrun: Any) -> None:
    engines = fakes(2)
    a, b = engines.values()

    async def main() -> None:
        async with router_over(engines) as router:
            await push(router, 1)
            b.freeze()  # SIGSTOP
            took = await push(router, 2)
            assert took == pytest.approx(POLICY.admin_timeout_s, abs=0.01)  # pause missed the deadline
            assert router.states == (A, B) and a.version == 2
            before = b.requests
            outs = await asyncio.gather(*(outcome(router, k) for k in range(6)))
            assert all(isinstance(o, GenerateOutput) and o.weight_versions == [2] * 10 for o in outs)
            assert b.requests == before  # excluded: no new request
            took = await push(router, 3)  # the next push does not wait for it at all
            assert took < 0.1
            b.thaw()  # SIGCONT: it rejoins with the current weights
            async with asyncio.timeout(20):
                await router.wait_for_healthy()
            assert b.version == 3 and b.model_path == "/w/v3"

    vrun(main())


def test_the_only_engine_frozen_then_thawed_rejoins_and_generation_resumes(vrun: Any) -> None:
    engines = fakes(1)
    (a,) = engines.values()

    async def main() -> None:
        async with router_over(engines) as router, asyncio.TaskGroup() as tg:
            await push(router, 1)
            a.freeze()
            await push(router, 2)  # the push completes with nobody in it; nothing is lost
            waiting = tg.create_task(outcome(router, 0))
            await asyncio.sleep(30)
            assert not waiting.done()  # waits for an engine, does not fail
            a.thaw()
            out = await waiting
            assert isinstance(out, GenerateOutput) and out.weight_versions == [2] * 10
            assert router.states == (A,)

    vrun(main())


def test_an_engine_that_keeps_failing_its_weight_load_stays_out_and_the_fleet_fails(vrun: Any) -> None:
    """A 400 to every weight load: excluded, never rejoins with stale weights; alone, the run fails once
    no engine has been usable for the deadline (not before)."""
    engines = fakes(1)
    (a,) = engines.values()
    policy = dataclasses.replace(POLICY, unavailable_deadline_s=50.0)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with router_over(engines, policy) as router:
            await push(router, 1)
            a.fail("update_weights_from_disk", EngineBadResponse("HTTP 400: cannot load"), times=10_000)
            t0 = loop.time()
            await push(router, 2)
            assert router.states == (B,)
            await asyncio.sleep(40)
            assert router.states == (B,) and a.version == 1  # still out: it never got the weights
            await asyncio.sleep(60)
        raise AssertionError(f"the router should have failed by {loop.time() - t0}")

    with pytest.raises(EngineUnavailable, match="no engine left: none of 1 engines has been usable for 50"):
        vrun(main())


def test_broadcast_weights_keep_a_rejoining_engine_on_standby_until_the_next_push(vrun: Any) -> None:
    engines = fakes(2)
    b = engines["fake://1"]

    async def main() -> None:
        async with router_over(engines) as router:
            await router.pause_generation("retract")
            key = router.membership_key()
            await router.update_weights_from_distributed(names=["w"], dtypes=["f32"], shapes=[[1]], version=1)
            await router.update_weight_version(1)
            await router.continue_generation()
            b.kill()
            await outcome(router, 0)  # it fails a request: OUT
            await asyncio.gather(*(outcome(router, k) for k in range(4)))
            assert router.states[1] is EngineState.OUT
            b.revive()  # a fresh server: no weights; none on disk either (they came by broadcast)
            await asyncio.sleep(3)
            assert router.states == (A, EngineState.STANDBY)
            before = b.requests
            await asyncio.gather(*(outcome(router, 10 + k) for k in range(4)))
            assert b.requests == before  # standby: no request before it has the weights
            await router.pause_generation("retract")
            assert router.membership_key() != key  # a new group must be formed
            assert len(router.push_clients()) == 2  # and it is in it
            await router.update_weights_from_distributed(names=["w"], dtypes=["f32"], shapes=[[1]], version=2)
            await router.update_weight_version(2)
            await router.continue_generation()
            assert router.states == (A, A) and b.version == 2

    vrun(main())


class FakeProcess:
    """An engine process for the supervisor: `die()` makes `wait()` return."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def die(self, rc: int = -9) -> None:
        self._exit.set_result(rc)

    async def wait(self) -> int:
        return await self._exit


class FakeLauncher:
    """Starts fake engines (a fresh URL each time) after `start_s`; `failures` starts fail first."""

    def __init__(
        self, engines: dict[str, FakeLatencyEngine], *, start_s: float = 2.0, failures: int = 0
    ) -> None:
        self.engines, self.start_s, self.failures = engines, start_s, failures
        self.started: list[tuple[float, int]] = []
        self.procs: list[FakeProcess] = []

    async def start(self, index: int) -> FakeProcess:
        loop = asyncio.get_running_loop()
        self.started.append((loop.time(), index))
        await asyncio.sleep(self.start_s)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("engine exited with code 1 before it was ready")
        url = f"fake://{index}-restart{len(self.procs)}"
        self.engines[url] = FakeLatencyEngine(lambda rng: 1.0, tokens_per_s=10.0, url=url)
        proc = FakeProcess(url, 1000 + len(self.procs))
        self.procs.append(proc)
        return proc


def supervised(
    n: int, launcher_kw: dict[str, Any], restarts: RestartPolicy
) -> Callable[[Callable[[EngineRouter, FakeLauncher, list[FakeProcess]], Any]], Any]:
    engines = fakes(n)

    async def run(body: Callable[[EngineRouter, FakeLauncher, list[FakeProcess]], Any]) -> None:
        launcher = FakeLauncher(engines, **launcher_kw)
        procs = [FakeProcess(url, i) for i, url in enumerate(list(engines))]
        async with router_over(engines) as router, asyncio.TaskGroup() as tg:
            sup = tg.create_task(
                supervise_engines(router, launcher, procs, restarts), name="engine-supervisor"
            )
            try:
                await body(router, launcher, procs)
            finally:
                sup.cancel()

    return run


def test_a_dead_engine_is_restarted_with_backoff_and_rejoins_at_its_new_url(vrun: Any) -> None:
    restarts = RestartPolicy(max_restarts=3, backoff_s=1.0, backoff_max_s=30.0)

    async def body(router: EngineRouter, launcher: FakeLauncher, procs: list[FakeProcess]) -> None:
        loop = asyncio.get_running_loop()
        await push(router, 1)
        await push(router, 2)
        t0 = loop.time()
        procs[0].die()
        await asyncio.sleep(0)
        assert router.states[0] is EngineState.RESTARTING
        async with asyncio.timeout(60):
            await router.wait_for_healthy()
        # backoff 1 s, a failed start (2 s), backoff 2 s, a good start (2 s): then probed and re-synced
        assert [round(t - t0, 3) for t, _ in launcher.started] == [1.0, 5.0]
        new = router.clients[0]
        assert new.url == "fake://0-restart0"
        assert launcher.engines[new.url].version == 2  # it rejoined with the current weights
        assert router.stats()["router/restarts"] == 1

    vrun(supervised(2, {"failures": 1}, restarts)(body))


def test_when_every_engine_is_dead_and_restarts_are_spent_the_fleet_fails(vrun: Any) -> None:
    restarts = RestartPolicy(max_restarts=2, backoff_s=1.0, backoff_max_s=30.0)

    async def body(router: EngineRouter, launcher: FakeLauncher, procs: list[FakeProcess]) -> None:
        await push(router, 1)
        for dying in (procs[0], None, None):  # restarted twice, then the restarts are spent
            (dying or launcher.procs[-1]).die()
            await asyncio.sleep(0.001)
            if router.states[0] is EngineState.LOST:
                break
            assert router.states[0] is EngineState.RESTARTING
            async with asyncio.timeout(60):
                await router.wait_for_healthy()
        assert router.states[0] is EngineState.LOST and len(launcher.procs) == 2
        await asyncio.sleep(1000)

    with pytest.raises(
        EngineUnavailable, match="no engine left: all 1 engines died and their restarts are spent"
    ):
        vrun(supervised(1, {}, restarts)(body))

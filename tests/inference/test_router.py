"""EngineRouter over real HTTP servers: balance, stickiness, failover when a server is killed and its
return on the same port, bounded retries, waiting while every engine is down, admin broadcasts, stats."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog

from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.client import FlushRefused
from miles_aio.inference.router import EngineRouter, RouterPolicy
from miles_aio.models.tiny import build_tiny_llama
from miles_aio.testing.sglang_stub_server import SGLangStubServer
from miles_aio.types import GenerateOutput
from tests.inference.helpers import StubProcess, expected_tokens, recorded, script, stub_processes

pytestmark = pytest.mark.procs

PROMPT = [1, 2, 3]
FAST = RouterPolicy(health_check_interval_s=0.05, retry_backoff_s=0.01, flush_backoff_s=0.01)


@contextlib.asynccontextmanager
async def stubs(n: int, *, token_latency_s: float = 0.0) -> AsyncIterator[list[SGLangStubServer]]:
    async with contextlib.AsyncExitStack() as stack:
        opened = [SGLangStubServer.open(token_latency_s=token_latency_s) for _ in range(n)]
        yield [await stack.enter_async_context(cm) for cm in opened]


@pytest.mark.timeout(120)
def test_killed_embedded_engine_is_routed_around_and_rejoins(tmp_path: Path) -> None:
    """The same failover with two real embedded engines (a real model behind each)."""
    model = build_tiny_llama(tmp_path / "m", alphabet="abcdef", hidden_size=32, num_heads=2, num_kv_heads=1)

    async def main() -> None:
        a, b = (StubProcess("--model-path", str(model), module="miles_aio.engine") for _ in range(2))
        await a.start()
        await b.start()
        try:
            async with EngineRouter.open([a.url, b.url], policy=FAST) as router:

                async def load(n: int, key_offset: int = 0) -> list[GenerateOutput]:
                    async with asyncio.TaskGroup() as tg:
                        tasks = [
                            tg.create_task(
                                router.generate(
                                    input_ids=[3, 4, 5],
                                    sampling_params={"max_new_tokens": 64, "ignore_eos": True},
                                    routing_key=key_offset + i,
                                )
                            )
                            for i in range(n)
                        ]
                    return [t.result() for t in tasks]

                async with asyncio.TaskGroup() as tg:
                    during = tg.create_task(load(200))  # every request must succeed despite the kill
                    await asyncio.sleep(0.2)
                    assert not during.done()  # the kill lands mid-load
                    await a.kill()
                assert all(len(o.output_ids) == 64 for o in during.result())
                stats = router.stats()
                assert stats["router/engine0/healthy"] == 0.0
                assert stats["router/engine0/failures"] >= 1 and stats["router/retries"] >= 1
                port = a.port
                await a.start()  # the engine comes back on the same port
                assert a.port == port
                async with asyncio.timeout(30):
                    await router.wait_for_healthy()
                before = router.stats()["router/engine0/requests"]
                await load(40, key_offset=1000)
                assert router.stats()["router/engine0/requests"] - before >= 10  # it takes traffic again
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_least_in_flight_balances_concurrent_requests() -> None:
    async def main() -> None:
        async with (
            stubs(3, token_latency_s=0.002) as servers,
            EngineRouter.open([s.url for s in servers], policy=FAST) as router,
        ):
            assert isinstance(router, InferenceEngine)
            async with asyncio.TaskGroup() as tg:
                for _ in range(300):
                    tg.create_task(router.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4}))
            counts = [s.counts["/generate"] for s in servers]
            assert sum(counts) == 300
            assert max(counts) - min(counts) <= 3, counts
            stats = router.stats()
            assert stats["router/requests"] == 300
            assert stats["router/failures"] == 0
            assert stats["router/in_flight"] == 0
            assert 0 < stats["router/latency_p50_s"] <= stats["router/latency_p99_s"]
            assert stats["router/engine0/requests"] == counts[0]

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_same_routing_key_goes_to_the_same_engine() -> None:
    async def main() -> None:
        async with stubs(3, token_latency_s=0.001) as servers:
            async with (
                EngineRouter.open([s.url for s in servers], policy=FAST) as router,
                asyncio.TaskGroup() as tg,
            ):
                # 40 groups x 4 turns, all concurrent
                answers = {}
                for turn in range(4):
                    for group in range(40):
                        answers[group, turn] = tg.create_task(
                            router.generate(
                                input_ids=[group, turn],
                                sampling_params={"max_new_tokens": 3},
                                routing_key=group,
                            )
                        )
            owner: dict[str, set[int]] = {}
            for i, s in enumerate(servers):
                for r in await recorded(s.url):
                    owner.setdefault(r["routing_key"], set()).add(i)
            assert len(owner) == 40
            assert all(len(v) == 1 for v in owner.values()), owner
            spread = Counter(next(iter(v)) for v in owner.values())
            assert len(spread) == 3
            assert min(spread.values()) >= 8, spread  # keys are still balanced
            # each answer names the engine that served it (the timeline's engine tracks use it)
            served = {key: task.result().meta["engine_index"] for key, task in answers.items()}
            assert all(served[group, turn] in owner[str(group)] for group, turn in served)

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_killed_engine_is_routed_around_and_rejoins_on_the_same_port() -> None:
    async def main() -> None:
        async with (
            stub_processes(2, "--token-latency-s", "0.005") as (a, b),
            EngineRouter.open([a.url, b.url], policy=FAST) as router,
        ):

            async def load(n: int, key_offset: int = 0) -> None:
                async with asyncio.TaskGroup() as tg:
                    for i in range(n):
                        tg.create_task(
                            router.generate(
                                input_ids=[i],
                                sampling_params={"max_new_tokens": 20},
                                routing_key=key_offset + i % 10,
                            )
                        )

            await load(40)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(load(200))  # every request must succeed despite the kill
                await asyncio.sleep(0.1)
                await a.kill()
            stats = router.stats()
            assert stats["router/engine0/healthy"] == 0.0
            assert stats["router/engines_healthy"] == 1.0
            assert stats["router/engine0/failures"] >= 1
            assert stats["router/retries"] >= 1
            assert stats["router/engine0/failures"] == stats["router/engine0/retries"]
            port = a.port
            await a.start()  # same port
            assert a.port == port
            async with asyncio.timeout(5):  # the health checker brings it back
                await router.wait_for_healthy()
            await load(100, key_offset=100)  # new keys: the old ones stay where their cache is
            rejoined = await recorded(a.url)
            assert len(rejoined) >= 20, len(rejoined)  # the restarted server takes traffic again

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_retries_are_bounded_and_bad_responses_are_not_retried() -> None:
    async def main() -> None:
        async with stubs(2) as servers:
            for s in servers:
                s.add_faults([{"kind": "status", "status": 503, "times": 100}])
            async with EngineRouter.open(
                [s.url for s in servers], policy=dataclasses.replace(FAST, max_retries=3)
            ) as router:
                with pytest.raises(EngineUnavailable, match="failed 4 times"):
                    await router.generate(input_ids=PROMPT, sampling_params={})
                assert sum(s.counts["/generate"] for s in servers) == 4  # 1 try + 3 retries
                stats = router.stats()
                assert stats["router/failures"] == 4
                assert stats["router/retries"] == 3
        async with stubs(2) as servers:
            for s in servers:
                s.add_faults([{"kind": "garbage"}])
            async with EngineRouter.open(
                [s.url for s in servers], policy=dataclasses.replace(FAST, max_retries=3)
            ) as router:
                # The engine answered, and broke the contract: raised at once, never retried elsewhere.
                with pytest.raises(EngineBadResponse, match="invalid JSON"):
                    await router.generate(input_ids=PROMPT, sampling_params={})
                assert sum(s.counts["/generate"] for s in servers) == 1
                assert router.stats()["router/engines_healthy"] == 2

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_all_down_waits_until_the_deadline_then_raises() -> None:
    async def main() -> None:
        async with stubs(1) as (stub,):
            url = stub.url
        async with EngineRouter.open(
            [url], policy=dataclasses.replace(FAST, unavailable_deadline_s=0.3)
        ) as router:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(EngineUnavailable, match="no healthy engine"):
                await router.generate(input_ids=PROMPT, sampling_params={})
            assert 0.3 <= loop.time() - t0 < 2.0

    asyncio.run(main())


@pytest.mark.timeout(20)
def test_all_down_waits_for_an_engine_to_come_back() -> None:
    async def main() -> None:
        async with (
            stub_processes(1) as (proc,),
            EngineRouter.open(
                [proc.url], policy=dataclasses.replace(FAST, unavailable_deadline_s=10, max_retries=5)
            ) as router,
        ):
            await proc.kill()
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(
                    router.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 3})
                )
                await asyncio.sleep(0.3)
                assert not task.done()  # waiting, not failing
                await proc.start()
            assert task.result().output_ids == expected_tokens(PROMPT, 3)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_close_wakes_generates_waiting_for_an_engine() -> None:
    async def main() -> None:
        async with stubs(1) as (stub,):
            url = stub.url
        # No health checker (plain constructor): nothing would ever bring the engine back.
        router = EngineRouter([url], policy=RouterPolicy(unavailable_deadline_s=30))

        async def attempt() -> EngineUnavailable | None:
            try:
                await router.generate(input_ids=PROMPT, sampling_params={})
            except EngineUnavailable as e:
                return e
            return None

        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(attempt())
            await asyncio.sleep(0.1)
            assert not task.done()
            await router.aclose()
        assert "closed" in str(task.result())

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_admin_calls_reach_every_engine_and_exclude_one_that_fails() -> None:
    async def main() -> None:
        async with stubs(2) as servers, EngineRouter.open([s.url for s in servers], policy=FAST) as router:
            await router.pause_generation("in_place")
            await router.continue_generation()
            await router.flush_cache()
            await router.update_weights_from_disk("/ckpt/3", version=3)
            await router.update_weight_version(4)
            await router.init_weights_update_group(
                master_address="h", master_port=1, rank_offsets=[1, 2], world_size=3
            )
            await router.update_weights_from_distributed(
                names=["w"], dtypes=["float32"], shapes=[[1]], version=5
            )
            for s in servers:
                assert s.weight_version == "5"
                assert s.model_path == "/ckpt/3"
                assert s.counts["/pause_generation"] == s.counts["/continue_generation"] == 1
            offsets = [
                (await recorded(s.url, "/init_weights_update_group"))[0]["body"]["rank_offset"]
                for s in servers
            ]
            assert offsets == [1, 2]
            servers[1].refuse_flushes = FAST.flush_attempts  # refused every try
            await router.flush_cache()  # excluded, not raised: the push goes on without it
            assert servers[0].counts["/flush_cache"] == 2  # the other engine was not cancelled
            assert servers[1].counts["/flush_cache"] == 1 + FAST.flush_attempts
            stats = router.stats()
            assert stats["router/exclusions"] == 1 and stats["router/engine1/exclusions"] == 1
            assert stats["router/engine1/healthy"] == 0.0
            async with asyncio.timeout(5):  # it answers again: probed, and back in rotation
                await router.wait_for_healthy()

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_flush_refused_while_requests_drain_is_asked_again_with_backoff() -> None:
    """SGLang answers 400 to /flush_cache while requests still run or wait (aborted ones draining after
    a pause): the router asks again, as miles does, and the push goes on with the engine still in it."""

    async def main() -> None:
        policy = dataclasses.replace(FAST, flush_backoff_s=0.05)
        async with stubs(2) as servers, EngineRouter.open([s.url for s in servers], policy=policy) as router:
            servers[1].refuse_flushes = 2
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await router.flush_cache()
            assert loop.time() - t0 >= 0.05 + 0.1  # backed off between the tries
            assert [s.counts["/flush_cache"] for s in servers] == [1, 3]
            stats = router.stats()
            assert stats["router/exclusions"] == 0 and stats["router/engine1/healthy"] == 1.0

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_flush_refused_on_every_try_gives_up_with_the_reason_and_excludes_the_engine() -> None:
    async def main() -> None:
        policy = dataclasses.replace(FAST, flush_attempts=3)
        async with stubs(1) as servers, EngineRouter.open([s.url for s in servers], policy=policy) as router:
            servers[0].refuse_flushes = 10
            with structlog.testing.capture_logs() as logs:
                await router.flush_cache()
            assert servers[0].counts["/flush_cache"] == 3
            assert router.stats()["router/engine0/exclusions"] == 1
            [excluded] = [e for e in logs if e["event"] == "engine_excluded"]
            assert excluded["call"] == "flush_cache"
            assert "still refused after 3 tries" in excluded["error"]
            assert "Cache not flushed" in excluded["error"]  # the engine's own words
            with pytest.raises(FlushRefused, match="HTTP 400"):  # the client alone: one try, no retry
                await router.clients[0].flush_cache()
            assert servers[0].counts["/flush_cache"] == 4

    asyncio.run(main())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("transfer", ["disk", "broadcast"])
def test_in_place_weight_update_with_frozen_requests_does_not_ask_for_a_flush(transfer: str) -> None:
    """SGLang refuses to flush while a request frozen in place holds KV, and an update call asking for a
    flush (its default) then fails: the router's updates leave the flush to the controller."""

    async def main() -> None:
        async with (
            stubs(1, token_latency_s=0.01) as servers,
            EngineRouter.open([s.url for s in servers], policy=FAST) as router,
        ):
            async with asyncio.TaskGroup() as tg:
                request = tg.create_task(
                    router.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 50})
                )
                await servers[0].wait_in_flight(1)
                await router.pause_generation("in_place")
                with pytest.raises(EngineError, match="flush_cache"):
                    await router.clients[0].flush_cache()  # the stub refuses, as SGLang does
                if transfer == "disk":
                    await router.update_weights_from_disk("/ckpt/2", version=2)
                else:
                    await router.update_weights_from_distributed(
                        names=["w"], dtypes=["float32"], shapes=[[1]], version=2
                    )
                await router.update_weight_version(2)
                await router.continue_generation()
            out = request.result()
            assert len(out.output_ids) == 50  # the frozen request resumed and finished
            assert out.weight_versions[-1] == 2  # its last tokens came from the new weights

    asyncio.run(main())


@pytest.mark.timeout(20)
def test_restarted_engine_gets_the_last_disk_weights_before_rejoining() -> None:
    async def main() -> None:
        async with stub_processes(2) as (a, b), EngineRouter.open([a.url, b.url], policy=FAST) as router:
            await router.update_weights_from_disk("/ckpt/7", version=7)
            await a.kill()
            out = await router.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
            assert out.weight_versions == [7, 7]  # failed over to b
            assert router.stats()["router/engine0/healthy"] == 0.0
            await a.start()  # a fresh server on the same port: weight_version "default"
            async with asyncio.timeout(5):
                await router.wait_for_healthy()
            assert await router.clients[0].weight_version() == 7
            body = (await recorded(a.url, "/update_weights_from_disk"))[-1]["body"]
            assert body["model_path"] == "/ckpt/7"
            assert body["weight_version"] == "7"

    asyncio.run(main())


@pytest.mark.timeout(5)
def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EngineRouter([])
    with pytest.raises(ValueError, match="max_retries=-1"):
        RouterPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="health_check_interval_s"):
        RouterPolicy(health_check_interval_s=0)
    with pytest.raises(ValueError, match="flush_attempts"):
        RouterPolicy(flush_attempts=0)


@pytest.mark.timeout(10)
def test_script_helper_drives_a_stub_over_http() -> None:
    async def main() -> None:
        async with (
            stubs(1) as (stub,),
            EngineRouter.open([stub.url], policy=dataclasses.replace(FAST, max_retries=0)) as router,
        ):
            await script(stub.url, faults=[{"kind": "status", "status": 502}], weight_version="9")
            with pytest.raises(EngineUnavailable, match="HTTP 502"):
                await router.generate(input_ids=PROMPT, sampling_params={})
            async with asyncio.timeout(5):
                await router.wait_for_healthy()
            out = await router.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
            assert out.weight_versions == [9, 9]

    asyncio.run(main())

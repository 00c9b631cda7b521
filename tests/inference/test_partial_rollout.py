"""Partial rollout over real HTTP: a generation aborted by a pause in abort mode keeps its tokens, waits
for continue_generation on the same handle, and resumes on the same engine with the rest of its budget;
each token keeps the policy version that produced it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from miles_aio.errors import EngineUnavailable
from miles_aio.inference.client import SGLangClient
from miles_aio.inference.router import EngineRouter
from miles_aio.testing.sglang_stub_server import SGLangStubServer
from miles_aio.types import GenerateOutput
from tests.inference.helpers import expected_tokens, recorded

pytestmark = pytest.mark.procs

PROMPT = [40, 41, 42]
BUDGET = 40
PARAMS = {"max_new_tokens": BUDGET, "temperature": 1.0, "min_new_tokens": 30}


@contextlib.asynccontextmanager
async def two_stubs() -> AsyncIterator[list[SGLangStubServer]]:
    async with (
        SGLangStubServer.open(token_latency_s=0.005) as a,
        SGLangStubServer.open(token_latency_s=0.005) as b,
    ):
        yield [a, b]


@pytest.mark.timeout(15)
def test_aborted_generation_continues_with_the_same_budget_and_per_token_versions() -> None:
    prompts = [[40, 41, 100 * k] for k in range(4)]

    async def main() -> None:
        async with two_stubs() as servers:
            async with EngineRouter.open([s.url for s in servers], partial_rollout=True) as router:
                await router.update_weight_version(1)
                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        tg.create_task(router.generate(input_ids=p, sampling_params=PARAMS)) for p in prompts
                    ]
                    for s in servers:
                        await s.wait_in_flight(2)
                    await asyncio.sleep(0.05)  # some tokens under version 1
                    await router.pause_generation("abort")  # in-flight requests come back aborted...
                    await asyncio.sleep(0.1)
                    assert not any(t.done() for t in tasks)  # ...and wait for continue_generation
                    await router.update_weight_version(2)
                    await router.continue_generation()
                assert router.stats()["router/partial_rollout_continuations"] == 4
            for prompt, task in zip(prompts, tasks, strict=True):
                out = task.result()
                assert out.finish_reason == "length"
                assert out.output_ids == expected_tokens(prompt, BUDGET)  # same tokens as uninterrupted
                assert out.output_log_probs == [-(t % 7 + 1) / 10 for t in out.output_ids]
                k = out.weight_versions.index(2)
                assert 0 < k < BUDGET
                assert out.weight_versions == [1] * k + [2] * (BUDGET - k)
                assert out.meta["partial_rollout_segments"] == 2
                assert out.prompt_tokens == len(prompt)
                assert out.text == "".join(f"{t} " for t in out.output_ids)
            for s in servers:  # each continuation went back to the engine that started it
                bodies = [r["body"] for r in await recorded(s.url)]
                originals, continuations = bodies[:2], bodies[2:]
                assert len(continuations) == 2
                assert all(b["input_ids"] in prompts for b in originals)
                for cont in continuations:
                    prompt = cont["input_ids"][:3]
                    produced = cont["input_ids"][3:]
                    assert prompt in [b["input_ids"] for b in originals]  # same engine
                    assert produced
                    assert produced == expected_tokens(prompt, len(produced))
                    params = cont["sampling_params"]
                    assert params["max_new_tokens"] == BUDGET - len(produced)  # the same total budget
                    assert params["min_new_tokens"] == max(0, 30 - len(produced))
                    assert params["temperature"] == 1.0
                    assert cont["rid"] not in [b["rid"] for b in originals]

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_without_partial_rollout_an_abort_is_returned_as_is() -> None:
    async def main() -> None:
        async with SGLangStubServer.open(token_latency_s=0.005) as stub, SGLangClient(stub.url) as client:
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(client.generate(input_ids=PROMPT, sampling_params=PARAMS))
                await stub.wait_in_flight(1)
                await asyncio.sleep(0.03)
                await client.pause_generation("abort")
            out = task.result()
            assert out.finish_reason == "abort"
            assert 0 < len(out.output_ids) < BUDGET
            assert out.output_ids == expected_tokens(PROMPT, len(out.output_ids))
            await client.continue_generation()

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_an_abort_that_no_pause_caused_is_not_continued() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub, SGLangClient(stub.url, partial_rollout=True) as client:
            stub.add_faults([{"kind": "abort", "after_tokens": 3}])  # e.g. an /abort_request by someone else
            out = await client.generate(input_ids=PROMPT, sampling_params=PARAMS)
            assert out.finish_reason == "abort"
            assert out.output_ids == expected_tokens(PROMPT, 3)
            assert stub.counts["/generate"] == 1
            assert client.continuations == 0

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_retract_pause_keeps_requests_on_the_server() -> None:
    async def main() -> None:
        async with (
            SGLangStubServer.open(token_latency_s=0.005) as stub,
            SGLangClient(stub.url, partial_rollout=True) as client,
        ):
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(client.generate(input_ids=PROMPT, sampling_params=PARAMS))
                await stub.wait_in_flight(1)
                await client.pause_generation("retract")
                await client.update_weight_version(3)
                await asyncio.sleep(0.05)
                assert not task.done()
                await client.continue_generation()
            out = task.result()
            assert out.finish_reason == "length"
            assert len(out.output_ids) == BUDGET
            assert out.weight_versions[-1] == 3
            assert stub.counts["/generate"] == 1  # one request, never resubmitted

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_closing_the_client_releases_a_waiting_continuation() -> None:
    async def main() -> None:
        async with SGLangStubServer.open(token_latency_s=0.005) as stub:
            client = SGLangClient(stub.url, partial_rollout=True)

            async def attempt() -> BaseException | GenerateOutput:
                try:
                    return await client.generate(input_ids=PROMPT, sampling_params=PARAMS)
                except EngineUnavailable as e:
                    return e

            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(attempt())
                await stub.wait_in_flight(1)
                await client.pause_generation("abort")
                await asyncio.sleep(0.05)
                assert not task.done()  # waiting for continue_generation
                await client.aclose()
            assert isinstance(task.result(), EngineUnavailable)
            assert "closed" in str(task.result())

    asyncio.run(main())

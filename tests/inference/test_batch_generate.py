"""`SGLangClient(batch_generate=True)`: a prompt group's calls made in one tick travel as ONE batch
`/generate` (SGLang's list-valued form, checked against SGLang's own schema by the stub), and each call
keeps its own outcome: its own answer, its own malformed-answer error, a resend of its own when the
server refuses the batch or the leading call is cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles_aio.errors import EngineBadResponse, EngineUnavailable
from miles_aio.inference.client import ClientTimeouts, SGLangClient
from miles_aio.inference.router import EngineRouter
from miles_aio.testing.sglang_stub_server import SGLangStubServer
from miles_aio.types import GenerateOutput
from tests.inference.helpers import expected_tokens, recorded

pytestmark = pytest.mark.procs

PROMPTS = [[100 + 10 * i, 101 + 10 * i, 102 + 10 * i] for i in range(8)]


async def _group(
    client: SGLangClient | EngineRouter, key: object, prompts: list[list[int]] = PROMPTS, max_new: int = 4
) -> list[GenerateOutput | BaseException]:
    """One call per prompt, all started in the same tick under one routing key (a rollout group)."""
    calls = [
        client.generate(input_ids=p, sampling_params={"max_new_tokens": max_new}, routing_key=key)
        for p in prompts
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


@pytest.mark.timeout(10)
def test_a_groups_calls_are_one_batch_request_and_each_gets_its_own_answer() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub:  # checks bodies against SGLang's schema
            async with SGLangClient(stub.url, batch_generate=True) as client:
                outs = await _group(client, ("group", 3))
                assert client.batched_requests == 1
            requests = await recorded(stub.url)
        assert len(requests) == 1
        body = requests[0]["body"]
        assert body["input_ids"] == PROMPTS
        assert body["sampling_params"] == [{"max_new_tokens": 4}] * 8
        assert len(set(body["rid"])) == 8  # a rid per call
        assert requests[0]["routing_key"] == str(("group", 3))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert isinstance(out, GenerateOutput)
            assert out.output_ids == expected_tokens(prompt, 4)
            assert out.prompt_tokens == 3

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_different_keys_no_key_and_batching_off_send_separately() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub:
            async with SGLangClient(stub.url, batch_generate=True) as client:
                await asyncio.gather(_group(client, "a", PROMPTS[:4]), _group(client, "b", PROMPTS[4:]))
                assert len(await recorded(stub.url)) == 2  # one batch per group
                await _group(client, None, PROMPTS[:3])  # no routing key: no group to batch
                assert len(await recorded(stub.url)) == 5
            async with SGLangClient(stub.url) as plain:  # batch_generate defaults to off
                outs = await _group(plain, "c", PROMPTS[:3])
                assert all(isinstance(o, GenerateOutput) for o in outs)
            assert len(await recorded(stub.url)) == 8
            assert all(
                not isinstance(r["body"]["input_ids"][0], list) for r in (await recorded(stub.url))[2:]
            )

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_batch_refused_with_a_4xx_is_resent_call_by_call() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub:
            stub.add_faults([{"kind": "status", "path": "/generate", "status": 400}])
            async with SGLangClient(stub.url, batch_generate=True) as client:
                outs = await _group(client, "g")
            requests = await recorded(stub.url)
        assert len(requests) == 1 + 8  # the refused batch, then each call alone
        assert all(r["body"]["input_ids"] in PROMPTS for r in requests[1:])
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert isinstance(out, GenerateOutput), out
            assert out.output_ids == expected_tokens(prompt, 4)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_malformed_item_fails_only_its_call() -> None:
    bad_first_token = expected_tokens(PROMPTS[5], 1)[0]

    def break_one(answer: dict[str, Any]) -> dict[str, Any]:
        if answer["output_ids"][:1] == [bad_first_token]:
            del answer["meta_info"]
        return answer

    async def main() -> None:
        async with SGLangStubServer.open() as stub:
            stub.add_faults([{"kind": "mutate", "path": "/generate", "apply": break_one}])
            async with SGLangClient(stub.url, batch_generate=True) as client:
                outs = await _group(client, "g")
            assert len(await recorded(stub.url)) == 1
        assert isinstance(outs[5], EngineBadResponse)
        assert "meta_info" in str(outs[5])
        for i, out in enumerate(outs):
            if i != 5:
                assert isinstance(out, GenerateOutput)
                assert out.output_ids == expected_tokens(PROMPTS[i], 4)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_5xx_fails_every_call_of_the_batch_each_with_its_own_error() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub:
            stub.add_faults([{"kind": "status", "path": "/generate", "status": 503}])
            async with SGLangClient(stub.url, batch_generate=True) as client:
                outs = await _group(client, "g")
        assert all(isinstance(o, EngineUnavailable) and "HTTP 503" in str(o) for o in outs)
        assert len({id(o) for o in outs}) == len(outs)  # never one exception raised in eight tasks

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_the_leading_call_cancelled_mid_batch_the_others_send_on_their_own() -> None:
    async def main() -> None:
        async with SGLangStubServer.open(token_latency_s=0.05) as stub:
            async with SGLangClient(stub.url, batch_generate=True) as client:
                tasks = [
                    asyncio.create_task(
                        client.generate(input_ids=p, sampling_params={"max_new_tokens": 4}, routing_key="g")
                    )
                    for p in PROMPTS[:4]
                ]
                await stub.wait_in_flight(4)  # the batch is being generated
                tasks[0].cancel()  # the leader: the first call of the tick
                outs = await asyncio.gather(*tasks, return_exceptions=True)
            requests = await recorded(stub.url)
        assert isinstance(outs[0], asyncio.CancelledError)
        for prompt, out in zip(PROMPTS[1:4], outs[1:], strict=True):
            assert isinstance(out, GenerateOutput), out
            assert out.output_ids == expected_tokens(prompt, 4)
        assert len(requests) == 1 + 3  # the batch, then each follower alone

    asyncio.run(main())


@pytest.mark.timeout(20)
def test_through_the_router_a_failed_batch_is_retried_call_by_call_on_the_other_engine() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as a, SGLangStubServer.open() as b:
            for stub in (a, b):  # whichever engine the group is routed to first fails it once
                stub.add_faults([{"kind": "status", "path": "/generate", "status": 503}])
            async with EngineRouter.open([a.url, b.url], batch_generate=True) as router:
                outs = await _group(router, ("group", 1))
            sent = [*(await recorded(a.url)), *(await recorded(b.url))]
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert isinstance(out, GenerateOutput), out
            assert out.output_ids == expected_tokens(prompt, 4)
        assert sum(isinstance(r["body"]["input_ids"][0], list) for r in sent) >= 1

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_batch_that_times_out_is_unavailable_to_every_call_and_aborts_every_rid() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub:
            stub.add_faults([{"kind": "delay", "delay_s": 1.0}])
            timeouts = ClientTimeouts(generate_s=0.2)
            async with SGLangClient(stub.url, timeouts=timeouts, batch_generate=True) as client:
                outs = await _group(client, "g", PROMPTS[:4])
            (sent,) = await recorded(stub.url)
            aborts = await recorded(stub.url, "/abort_request")
        assert all(isinstance(o, EngineUnavailable) and "timed out" in str(o) for o in outs)
        assert sorted(a["body"]["rid"] for a in aborts) == sorted(sent["body"]["rid"])

    asyncio.run(main())

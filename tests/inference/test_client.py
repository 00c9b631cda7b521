"""SGLangClient against a real HTTP server (the scripted SGLang stub): decoding, wire fields, every
malformed-response kind, timeouts, weight-version spans and the abort_all_requests guard."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.client import ClientTimeouts, FlushRefused, SGLangClient
from miles_aio.inference.wire import join_pieces, parse_wire_version, wire_version
from miles_aio.testing.sglang_stub_server import SGLangStubServer, load_sglang_api_types
from miles_aio.types import FinishReason, GenerateOutput, Sample
from tests.inference.helpers import expected_tokens, recorded

pytestmark = pytest.mark.procs

PROMPT = [11, 12, 13]


@pytest.mark.timeout(10)
def test_generate_decodes_and_sends_sglang_fields() -> None:
    async def main() -> None:
        async with SGLangStubServer.open(api_key="sekrit") as stub:
            async with SGLangClient(stub.url, api_key="sekrit") as client:
                assert isinstance(client, InferenceEngine)
                out = await client.generate(
                    input_ids=PROMPT, sampling_params={"max_new_tokens": 5}, routing_key=("group", 7)
                )
                again = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
                await client.update_weight_version(1)  # control calls carry the key too
                assert await client.weight_version() == 1
            assert out.output_ids == expected_tokens(PROMPT, 5)
            assert out.output_log_probs == [-(t % 7 + 1) / 10 for t in out.output_ids]
            assert out.weight_versions == [None] * 5  # "default" on the wire: unknown
            assert out.finish_reason == "length"
            assert out.text == "".join(f"{t} " for t in out.output_ids)
            assert out.prompt_tokens == 3
            assert out.cached_tokens == 0
            assert "output_token_logprobs" not in out.meta
            assert out.meta["completion_tokens"] == 5
            assert again.output_ids == expected_tokens(PROMPT, 2)
            first, second = await recorded(stub.url)
            assert first["body"]["return_logprob"] is True
            assert first["body"]["stream"] is False
            assert first["body"]["input_ids"] == PROMPT
            assert first["body"]["sampling_params"] == {"max_new_tokens": 5}
            assert first["body"]["rid"] != second["body"]["rid"]  # a fresh rid per request
            assert first["routing_key"] == str(("group", 7))
            assert second["routing_key"] is None

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_wrong_api_key_is_a_bad_response_and_closed_client_is_unavailable() -> None:
    async def main() -> None:
        async with SGLangStubServer.open(api_key="right") as stub:
            client = SGLangClient(stub.url, api_key="wrong")
            with pytest.raises(EngineBadResponse, match="HTTP 401"):
                await client.generate(input_ids=PROMPT, sampling_params={})
            await client.aclose()
            with pytest.raises(EngineUnavailable, match="closed"):
                await client.generate(input_ids=PROMPT, sampling_params={})
            with pytest.raises(EngineUnavailable, match="closed"):
                await client.flush_cache()

    asyncio.run(main())


BAD_RESPONSES: list[tuple[str, dict[str, Any], type[EngineError], str]] = [
    ("http_500", {"kind": "status", "status": 500}, EngineUnavailable, "HTTP 500"),
    ("http_503", {"kind": "status", "status": 503}, EngineUnavailable, "HTTP 503"),
    ("http_400", {"kind": "status", "status": 400}, EngineBadResponse, "HTTP 400"),
    ("dropped_connection", {"kind": "drop"}, EngineUnavailable, "RemoteProtocolError"),
    ("garbage_json", {"kind": "garbage"}, EngineBadResponse, "invalid JSON"),
    ("missing_output_ids", {"kind": "mutate", "delete": ["output_ids"]}, EngineBadResponse, "'output_ids'"),
    ("missing_meta_info", {"kind": "mutate", "delete": ["meta_info"]}, EngineBadResponse, "'meta_info'"),
    (
        "missing_logprobs",
        {"kind": "mutate", "delete": ["meta_info.output_token_logprobs"]},
        EngineBadResponse,
        "'output_token_logprobs'",
    ),
    (
        "missing_finish_reason",
        {"kind": "mutate", "set": {"meta_info.finish_reason": None}},
        EngineBadResponse,
        "'finish_reason'",
    ),
    (
        "missing_weight_version",
        {"kind": "mutate", "delete": ["meta_info.weight_version"]},
        EngineBadResponse,
        "'weight_version'",
    ),
    ("text_not_str", {"kind": "mutate", "set": {"text": 5}}, EngineBadResponse, "'text'"),
    (
        "output_ids_not_list",
        {"kind": "mutate", "set": {"output_ids": "1 2"}},
        EngineBadResponse,
        "'output_ids'",
    ),
    (
        "token_id_float",
        {"kind": "mutate", "set": {"output_ids.0": 1.5}},
        EngineBadResponse,
        "output_ids\\[0\\]",
    ),
    (
        "prompt_tokens_bool",
        {"kind": "mutate", "set": {"meta_info.prompt_tokens": True}},
        EngineBadResponse,
        "'prompt_tokens'",
    ),
    (
        "logprob_count",
        {"kind": "mutate", "delete": ["meta_info.output_token_logprobs.-1"]},
        EngineBadResponse,
        "3 output_token_logprobs for 4 output_ids",
    ),
    (
        "logprob_token_mismatch",
        {"kind": "mutate", "set": {"meta_info.output_token_logprobs.2.1": 999}},
        EngineBadResponse,
        "token id 999",
    ),
    (
        "logprob_null",
        {"kind": "mutate", "set": {"meta_info.output_token_logprobs.0.0": None}},
        EngineBadResponse,
        "not a number",
    ),
    (
        "logprob_entry_shape",
        {"kind": "mutate", "set": {"meta_info.output_token_logprobs.1": [-0.5]}},
        EngineBadResponse,
        "not \\[logprob,id,text\\]",
    ),
    (
        "finish_type_unknown",
        {"kind": "mutate", "set": {"meta_info.finish_reason": {"type": "eos"}}},
        EngineBadResponse,
        "'eos'",
    ),
    (
        "version_not_decimal",
        {"kind": "mutate", "set": {"meta_info.weight_version": "v7"}},
        EngineBadResponse,
        "'v7'",
    ),
    (
        "spans_short",
        {"kind": "mutate", "set": {"meta_info.weight_versions": [{"version": "1", "start": 0, "end": 3}]}},
        EngineBadResponse,
        "cover 3 tokens, output has 4",
    ),
    (
        "spans_gap",
        {
            "kind": "mutate",
            "set": {
                "meta_info.weight_versions": [
                    {"version": "1", "start": 0, "end": 2},
                    {"version": "2", "start": 3, "end": 4},
                ]
            },
        },
        EngineBadResponse,
        "does not continue at 2",
    ),
]


@pytest.mark.timeout(20)
def test_every_malformed_response_becomes_the_right_exception() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub, SGLangClient(stub.url) as client:
            for name, fault, exc, message in BAD_RESPONSES:
                stub.add_faults([fault])
                with pytest.raises(exc, match=message):
                    await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4})
                # The connection pool survives: the next request is fine.
                ok = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4})
                assert ok.output_ids == expected_tokens(PROMPT, 4), name

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_timeout_is_unavailable_and_aborts_the_request_on_the_server() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub:
            timeouts = ClientTimeouts(generate_s=0.2)
            async with SGLangClient(stub.url, timeouts=timeouts) as client:
                stub.add_faults([{"kind": "delay", "delay_s": 1.0}])
                with pytest.raises(EngineUnavailable, match="timed out"):
                    await client.generate(input_ids=PROMPT, sampling_params={})
            (sent,) = await recorded(stub.url)
            (abort,) = await recorded(stub.url, "/abort_request")
            assert abort["body"] == {"rid": sent["body"]["rid"], "abort_all": False}
        with pytest.raises(ValueError, match="generate_s"):
            ClientTimeouts(generate_s=0)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_nothing_listening_is_unavailable() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub:
            url = stub.url
        async with SGLangClient(url) as client:  # the server is gone; its port refuses connections
            with pytest.raises(EngineUnavailable, match="ConnectError"):
                await client.generate(input_ids=PROMPT, sampling_params={})
            with pytest.raises(EngineUnavailable):
                await client.health_generate()

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_version_bump_mid_request_gives_per_token_versions_and_never_aborts() -> None:
    async def main() -> None:
        async with SGLangStubServer.open(token_latency_s=0.01) as stub, SGLangClient(stub.url) as client:
            await client.update_weight_version(1)
            task = asyncio.create_task(
                client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 30})
            )
            await stub.wait_in_flight(1)
            await asyncio.sleep(0.08)  # a few tokens under version 1
            await client.update_weight_version(2)
            out = await task
            assert out.finish_reason == "length"
            assert len(out.output_ids) == 30
            k = out.weight_versions.index(2)
            assert 0 < k < 30
            assert out.weight_versions == [1] * k + [2] * (30 - k)
            bodies = [r["body"] for r in await recorded(stub.url, "/update_weight_version")]
            assert bodies == [
                {"new_version": "1", "abort_all_requests": False},
                {"new_version": "2", "abort_all_requests": False},
            ]
            assert await client.weight_version() == 2

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_admin_calls_speak_sglang_field_names() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub, SGLangClient(stub.url) as client:
            await client.pause_generation("retract")
            await client.continue_generation()
            await client.flush_cache()
            await client.update_weights_from_disk("/ckpt/step3", version=3)
            await client.init_weights_update_group(
                master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3
            )
            await client.update_weights_from_distributed(
                names=["w"], dtypes=["bfloat16"], shapes=[[2, 2]], version=4
            )
            await client.abort_request(abort_all=True)
            await client.health_generate()
            assert (await client.model_info())["weight_version"] == "4"
            assert (await client.server_info())["stub"] is True
            with pytest.raises(ValueError, match="rid"):
                await client.abort_request()
            with pytest.raises(ValueError, match="n must be 1"):
                await client.generate(input_ids=PROMPT, sampling_params={"n": 2})

            async def body(path: str) -> Any:
                return (await recorded(stub.url, path))[-1]["body"]

            assert await body("/pause_generation") == {"mode": "retract"}
            assert await body("/update_weights_from_disk") == {
                "model_path": "/ckpt/step3",
                "weight_version": "3",
                "flush_cache": True,
                "abort_all_requests": False,
            }
            assert await body("/init_weights_update_group") == {
                "master_address": "10.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 3,
                "group_name": "weight_update_group",
                "backend": "nccl",
            }
            assert await body("/update_weights_from_distributed") == {
                "names": ["w"],
                "dtypes": ["bfloat16"],
                "shapes": [[2, 2]],
                "group_name": "weight_update_group",
                "flush_cache": True,
                "abort_all_requests": False,
                "weight_version": "4",
            }
            assert await body("/abort_request") == {"rid": "", "abort_all": True}
            stub.add_faults([{"kind": "status", "status": 400, "path": "/update_weights_from_disk"}])
            with pytest.raises(EngineBadResponse, match="HTTP 400"):
                await client.update_weights_from_disk("/nope", version=5)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_refused_flush_is_flush_refused_and_the_version_falls_back_to_get_weight_version() -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as stub, SGLangClient(stub.url) as client:
            stub.refuse_flushes = 1
            with pytest.raises(FlushRefused, match="HTTP 400: Cache not flushed") as refused:
                await client.flush_cache()
            assert isinstance(refused.value, EngineBadResponse)  # what it always was, now recognisable
            await client.flush_cache()  # no longer refused
            stub.add_faults([{"kind": "status", "status": 401, "path": "/flush_cache"}])
            with pytest.raises(EngineBadResponse) as other:
                await client.flush_cache()
            assert not isinstance(other.value, FlushRefused)  # only a 400 is the "still busy" answer
            await client.update_weight_version(6)
            stub.legacy_weight_version = True  # an older SGLang: /model_info has no weight_version
            assert "weight_version" not in await client.model_info()
            assert await client.weight_version() == 6  # read from /get_weight_version, as miles does
            assert stub.counts["/get_weight_version"] == 1

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_sample_keeps_cached_tokens_summed_over_its_engine_calls() -> None:
    """SGLang's `meta_info.cached_tokens` reaches the Sample (miles' `prefix_cache_info.cached_tokens`),
    summed over the turns of a multi-turn sample; a retry forgets it, a checkpoint keeps it."""

    async def main() -> Sample:
        async with SGLangStubServer.open() as stub, SGLangClient(stub.url) as client:
            stub.add_faults(
                [
                    {"kind": "mutate", "set": {"meta_info.cached_tokens": 2}},
                    {"kind": "mutate", "set": {"meta_info.cached_tokens": 5}},
                ]
            )
            sample = Sample(group_index=0, index=0, prompt="p", tokens=list(PROMPT))
            params = {"max_new_tokens": 2}
            sample.append(await client.generate(input_ids=sample.tokens, sampling_params=params))
            sample.append_context([1, 2])  # a tool's answer: no engine call, nothing cached
            sample.append(await client.generate(input_ids=sample.tokens, sampling_params=params))
            return sample

    sample = asyncio.run(main())
    assert sample.cached_tokens == 7
    assert Sample.from_dict(sample.to_dict()).cached_tokens == 7
    sample.reset_for_retry()
    assert sample.cached_tokens == 0


@pytest.mark.timeout(5)
def test_wire_versions_and_joining_pieces() -> None:
    assert wire_version(3) == "3"
    assert parse_wire_version("12", "x") == 12
    assert parse_wire_version("default", "x") is None
    for bad in ("-1", "1.0", " 1", 7, None):
        with pytest.raises(EngineBadResponse, match="weight version"):
            parse_wire_version(bad, "x")
    with pytest.raises(ValueError, match=">= 0"):
        wire_version(-1)

    def piece(ids: list[int], version: int, finish: FinishReason) -> GenerateOutput:
        n = len(ids)
        text = "".join(f"{t} " for t in ids)
        return GenerateOutput(
            text=text,
            output_ids=ids,
            output_log_probs=[-0.5] * n,
            weight_versions=[version] * n,
            finish_reason=finish,
            prompt_tokens=4,
            cached_tokens=1,
            meta={"id": str(version)},
        )

    joined = join_pieces([piece([1, 2], 1, "abort"), piece([3], 2, "stop")], max_new_tokens=8)
    assert joined.output_ids == [1, 2, 3]
    assert joined.weight_versions == [1, 1, 2]
    assert joined.finish_reason == "stop"
    assert joined.text == "1 2 3 "
    assert joined.prompt_tokens == 4  # the original prompt, not the resubmitted one
    assert joined.cached_tokens == 2
    assert joined.meta == {"id": "2", "partial_rollout_segments": 2}
    continued = Sample(group_index=0, index=0, prompt="p", tokens=[9])
    continued.append(joined)
    assert continued.cached_tokens == 2  # both requests' cache hits, as miles adds each call's meta_info
    # An abort that landed exactly on the last token of the budget is a finished, truncated generation.
    assert (
        join_pieces([piece([1], 1, "abort"), piece([2], 2, "abort")], max_new_tokens=2).finish_reason
        == "length"
    )


@pytest.mark.timeout(10)
def test_a_body_sglang_rejects_is_a_bad_response() -> None:
    if load_sglang_api_types() is None:
        pytest.skip(
            "sglang is not installed (pip install --no-deps sglang): the stub cannot apply its schema"
        )

    async def main() -> None:
        async with SGLangStubServer.open() as stub, SGLangClient(stub.url) as client:
            with pytest.raises(EngineBadResponse, match="HTTP 400: unknown field `max_tokens`"):
                await client.generate(input_ids=PROMPT, sampling_params={"max_tokens": 3})  # OpenAI's name

    asyncio.run(main())

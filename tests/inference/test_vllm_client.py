"""`VLLMClient` against `FakeVLLMServer` (the HTTP seam), on virtual time: request mapping, answer
validation, error mapping, and the client-side per-token versions across pauses, checked against the
weights that really made each token (the fake encodes them in the token id)."""

from __future__ import annotations

import asyncio
import functools
import random
import re
from typing import Any

import httpx
import pytest

from miles_aio.errors import EngineBadResponse, EngineUnavailable
from miles_aio.inference.base import GenerateChunk, PauseMode
from miles_aio.inference.client import FlushRefused
from miles_aio.inference.router import EngineRouter, RouterPolicy
from miles_aio.inference.vllm import VLLMClient, completion_params, parse_completion
from miles_aio.types import GenerateOutput
from tests.conftest import run_virtual
from tests.inference.vllm_fake import TOKEN_BASE, FakeVLLMServer

PROMPT = [5, 6, 7]


def _client(fake: FakeVLLMServer, **kw: Any) -> VLLMClient:
    return VLLMClient("http://fake-vllm", transport=fake.transport(), **kw)


_join = functools.partial(
    VLLMClient.init_weights_update_group,
    master_address="127.0.0.1",
    master_port=2,
    rank_offset=1,
    world_size=2,
)
"""Join a (fake) trainer's weight-transfer group of 2: rank 0 and this server's one worker."""


def _assert_versions_exact(out: GenerateOutput, version_of_weights: dict[int, int | None]) -> None:
    truth = [version_of_weights[t // TOKEN_BASE] for t in out.output_ids]
    assert out.weight_versions == truth


# ---- pure: params and answers ---------------------------------------------------------------------


@pytest.mark.pure
def test_completion_params_map_sglang_names_and_refuse_the_rest() -> None:
    params = completion_params(
        {"max_new_tokens": 4, "temperature": 1.0, "top_k": -1, "no_stop_trim": True, "sampling_seed": 3}
    )
    assert params == {
        "max_tokens": 4,
        "temperature": 1.0,
        "top_k": -1,
        "include_stop_str_in_output": True,
        "seed": 3,
    }
    assert completion_params({})["max_tokens"] == 128  # SGLang's default, not vLLM's 16
    with pytest.raises(ValueError, match="logit_bias"):
        completion_params({"logit_bias": {}})
    with pytest.raises(ValueError, match="n must be 1"):
        completion_params({"n": 2})


@pytest.mark.pure
@pytest.mark.parametrize(
    ("choice", "needle"),
    [
        ({"finish_reason": "repetition", "token_ids": [], "text": ""}, "finish_reason"),
        ({"finish_reason": "stop", "text": ""}, "token_ids"),
        ({"finish_reason": "stop", "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}, "logprobs"),
        ({"finish_reason": "stop", "token_ids": [1], "logprobs": {"token_logprobs": [0.5]}}, "<= 0"),
        ({"finish_reason": "stop", "token_ids": [-1], "logprobs": {"token_logprobs": [-1.0]}}, "token_ids"),
    ],
)
def test_answers_that_break_the_contract_are_bad_responses(choice: dict[str, Any], needle: str) -> None:
    with pytest.raises(EngineBadResponse, match=needle):
        parse_completion({"choices": [choice]}, version=1, where="w")
    with pytest.raises(EngineBadResponse, match="one choice"):
        parse_completion({"choices": [choice, choice]}, version=1, where="w")


@pytest.mark.pure
def test_a_good_answer_is_decoded_with_its_version() -> None:
    body = {
        "choices": [
            {
                "finish_reason": "length",
                "token_ids": [3, 4],
                "text": "ab",
                "logprobs": {"token_logprobs": [-0.1, -0.2]},
            }
        ],
        "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    out = parse_completion(body, version=7, where="w")
    assert (out.output_ids, out.output_log_probs, out.weight_versions) == ([3, 4], [-0.1, -0.2], [7, 7])
    assert (out.finish_reason, out.prompt_tokens, out.cached_tokens, out.text) == ("length", 5, 2, "ab")


# ---- vtime: the client against the fake -----------------------------------------------------------


@pytest.mark.vtime
def test_generate_sends_token_ids_and_reads_the_servers_version() -> None:
    fake = FakeVLLMServer()
    fake.version = "3"

    async def main() -> GenerateOutput:
        async with _client(fake) as client:
            return await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4})

    out = run_virtual(main())
    assert out.weight_versions == [3] * 4
    assert out.finish_reason == "length"
    body = next(b for p, b in fake.calls if p == "/v1/completions")
    assert body["prompt"] == PROMPT
    assert (body["max_tokens"], body["logprobs"], body["return_token_ids"], body["stream"]) == (
        4,
        0,
        True,
        False,
    )


@pytest.mark.vtime
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("network_latency_s", [0.0, 0.05])
def test_versions_stay_exact_over_many_pushes_in_every_mode(network_latency_s: float, stream: bool) -> None:
    """Twelve generations and six pushes (random modes); every token's version is the one whose
    weights made it, also when a request reaches the server only after the pause (a straggler).
    Streamed (SSE chunks), every chunk carries its tokens' exact versions and the chunks join to the
    output."""
    rng = random.Random(0)
    fake = FakeVLLMServer(token_latency_s=0.01, network_latency_s=network_latency_s)
    version_of_weights: dict[int, int | None] = {0: None}
    chunks: dict[int, list[GenerateChunk]] = {i: [] for i in range(12)}

    async def one(client: VLLMClient, i: int, params: dict[str, Any]) -> GenerateOutput:
        if not stream:
            return await client.generate(input_ids=[*PROMPT, i], sampling_params=params)

        async def sink(chunk: GenerateChunk) -> None:
            chunks[i].append(chunk)

        return await client.generate_stream(input_ids=[*PROMPT, i], sampling_params=params, on_chunk=sink)

    async def main() -> list[GenerateOutput]:
        async with _client(fake, partial_rollout=True) as client:
            params = {"max_new_tokens": 60, "ignore_eos": True}
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(client, i, params)) for i in range(12)]
                for v in range(1, 7):
                    await asyncio.sleep(rng.uniform(0.02, 0.12))
                    mode: PauseMode = rng.choice(["abort", "retract", "in_place"])
                    await client.pause_generation(mode)
                    await client.flush_cache()
                    await client.update_weights_from_disk(f"/w/v{v}", version=v, flush_cache=False)
                    version_of_weights[fake.weights] = v
                    await client.continue_generation()
            assert client.continuations > 0
            return [t.result() for t in tasks]

    outs = run_virtual(main())
    for i, out in enumerate(outs):
        assert out.finish_reason == "length"
        assert len(out.output_ids) == 60
        _assert_versions_exact(out, version_of_weights)
        if stream:
            assert len(chunks[i]) > 1
            assert [t for c in chunks[i] for t in c.output_ids] == out.output_ids
            assert [lp for c in chunks[i] for lp in c.output_log_probs] == out.output_log_probs
            assert [v for c in chunks[i] for v in c.weight_versions] == out.weight_versions
    assert len({v for out in outs for v in out.weight_versions}) > 2
    assert fake.loaded == [f"/w/v{v}" for v in range(1, 7)]
    assert not fake.requests


@pytest.mark.vtime
def test_abort_pause_without_partial_rollout_returns_the_aborted_tokens() -> None:
    fake = FakeVLLMServer()

    async def main() -> GenerateOutput:
        async with _client(fake) as client:
            await client.update_weight_version(1)
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(
                    client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 50})
                )
                await asyncio.sleep(0.105)
                await client.pause_generation("abort")
                out = await task
                await client.continue_generation()
            return out

    out = run_virtual(main())
    assert out.finish_reason == "abort"
    assert len(out.output_ids) == 10
    assert out.weight_versions == [1] * 10


@pytest.mark.vtime
def test_retract_continues_the_request_and_splits_it_at_the_resume() -> None:
    fake = FakeVLLMServer()

    async def main() -> GenerateOutput:
        async with _client(fake) as client:  # no partial rollout: retract continues anyway
            await client.update_weight_version(1)
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(
                    client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 50})
                )
                await asyncio.sleep(0.105)
                await client.pause_generation("retract")
                await asyncio.sleep(1.0)  # the weights load meanwhile: nothing is made while paused
                assert not task.done()
                await client.update_weights_from_disk("/w/2", version=2, flush_cache=True)
                await client.continue_generation()
            return task.result()

    out = run_virtual(main())
    assert out.finish_reason == "length"
    assert out.weight_versions == [1] * 10 + [2] * 40
    assert out.meta["partial_rollout_segments"] == 2
    pieces = [b for p, b in fake.calls if p == "/v1/completions"]
    assert pieces[1]["prompt"] == PROMPT + out.output_ids[:10]
    assert pieces[1]["max_tokens"] == 40
    assert ("/pause", {"mode": "keep", "clear_cache": "false"}) in fake.calls
    flush = [b for p, b in fake.calls if p == "/reset_prefix_cache"]
    assert flush == [{"reset_running_requests": "true"}]  # while paused: frozen requests preempted


@pytest.mark.vtime
def test_no_piece_is_sent_while_paused() -> None:
    fake = FakeVLLMServer()

    async def main() -> GenerateOutput:
        async with _client(fake) as client:
            await client.update_weight_version(1)
            await client.pause_generation("abort")
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(
                    client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 5})
                )
                await asyncio.sleep(5.0)
                assert not any(p == "/v1/completions" for p, _ in fake.calls)
                await client.update_weight_version(2)
                await client.continue_generation()
            return task.result()

    out = run_virtual(main())
    assert out.weight_versions == [2] * 5


@pytest.mark.vtime
def test_a_connection_cut_before_the_answer_is_asked_once_more() -> None:
    fake = FakeVLLMServer()

    async def main() -> None:
        async with _client(fake) as client:
            fake.disconnects = 1
            out = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 3})
            assert len(out.output_ids) == 3
            fake.disconnects = 2
            with pytest.raises(EngineUnavailable, match="RemoteProtocolError"):
                await client.continue_generation()

    run_virtual(main())


@pytest.mark.vtime
def test_errors_map_onto_engine_errors() -> None:
    fake = FakeVLLMServer()

    async def main() -> None:
        async with _client(fake) as client:
            fake.fail_status["/pause"] = 500
            with pytest.raises(EngineUnavailable, match="HTTP 500"):
                await client.pause_generation("abort")
            fake.fail_status = {"/resume": 404}
            with pytest.raises(EngineBadResponse, match="VLLM_SERVER_DEV_MODE"):
                await client.continue_generation()
            fake.fail_status = {}
            fake.refuse_flushes = 1
            with pytest.raises(FlushRefused):
                await client.flush_cache()
            await client.flush_cache()
            info = await client.server_info()
            assert (info["engine"], info["tp_size"], info["disable_radix_cache"]) == ("vllm", 1, False)
        with pytest.raises(EngineUnavailable, match="closed"):
            await client.generate(input_ids=PROMPT, sampling_params={})

    run_virtual(main())


@pytest.mark.vtime
def test_the_router_drives_vllm_clients_through_a_push() -> None:
    """The controller's view: an EngineRouter over two vLLM servers (client_factory), one push from disk."""
    fakes = {"http://a": FakeVLLMServer(), "http://b": FakeVLLMServer()}

    def factory(url: str) -> VLLMClient:
        return VLLMClient(url, transport=fakes[url].transport(), partial_rollout=True)

    async def main() -> list[GenerateOutput]:
        policy = RouterPolicy(admin_timeout_s=30.0)
        async with EngineRouter.open(list(fakes), client_factory=factory, policy=policy) as router:
            await router.update_weight_version(1)
            params = {"max_new_tokens": 30}
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(router.generate(input_ids=[*PROMPT, i], sampling_params=params))
                    for i in range(6)
                ]
                await asyncio.sleep(0.1)
                await router.pause_generation("retract")
                await router.flush_cache()
                await router.update_weights_from_disk("/w/2", version=2)
                await router.continue_generation()
            assert router.stats()["router/exclusions"] == 0
            return [t.result() for t in tasks]

    outs = run_virtual(main())
    for out in outs:
        _assert_versions_exact(out, {0: 1, 1: 2})
        assert len(out.output_ids) == 30
    assert all(f.loaded == ["/w/2"] for f in fakes.values())


_REQUIRED = ["--rollout-batch-size", "2", "--num-rollout", "1", "--use-tis"]


@pytest.mark.pure
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--vllm-urls", "http://a"], "--vllm-urls, --rollout-backend"),
        (["--rollout-backend", "vllm", "--sglang-urls", "http://a"], "--sglang-urls, --rollout-backend"),
    ],
)
def test_bad_vllm_flags_exit_2_naming_them(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles_aio.cli import parse_run_config

    with pytest.raises(SystemExit) as exit_info:
        parse_run_config([*_REQUIRED, *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.pure
def test_vllm_urls_are_the_engines() -> None:
    from miles_aio.cli import parse_run_config

    cfg = parse_run_config([*_REQUIRED, "--rollout-backend", "vllm", "--vllm-urls", "http://a", "http://b"])
    assert cfg.engine.num_engines == 2
    assert cfg.engine.vllm_urls == ("http://a", "http://b")


@pytest.mark.pure
@pytest.mark.parametrize("cuda", [False, True])
def test_vllm_broadcast_needs_cuda_and_asks_the_servers_for_it(
    cuda: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's weight transfer is NCCL only: without CUDA on a one-node run the flags exit 2 naming them,
    before anything starts; with it the launched servers get the weight-transfer config their routes need."""
    import torch

    from miles_aio.cli import parse_run_config
    from miles_aio.inference.engines import vllm_launch_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    argv = [*_REQUIRED, "--rollout-backend", "vllm", "--update-weight-transfer-mode", "broadcast"]
    if not cuda:
        with pytest.raises(SystemExit) as exit_info:
            parse_run_config(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--update-weight-transfer-mode, --rollout-backend" in err and "NCCL only" in err
        # ranks on other nodes: this host's CUDA says nothing of theirs (they report their device)
        multi_node = [*argv, "--actor-num-nodes", "2", "--trainer-host", "10.0.0.5"]
        assert parse_run_config(multi_node).train.actor_num_nodes == 2
        return
    args = vllm_launch_args(parse_run_config(argv))
    assert args[args.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert "--weight-transfer-config" not in vllm_launch_args(parse_run_config(argv[:-2]))


# ---- weights by broadcast (vLLM's NCCL weight-transfer routes) --------------------------------------


def test_broadcast_push_uses_vllms_transfer_routes_in_order() -> None:
    """Join: `init_info` as vLLM's worker reads it. A push of two buckets is ONE vLLM update: start,
    update (names, dtype_names, shapes) per bucket, finish after the last, then the flush and the
    version stamp; pieces after it carry the new version and the pieces before it the old one (its own
    pause, outside a controller pause, spans both buckets). Leave: shutdown."""
    fake = FakeVLLMServer()
    buckets: list[dict[str, Any]] = [
        {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]},
        {"names": ["c"], "dtype_names": ["bfloat16"], "shapes": [[5]]},
    ]

    async def main() -> tuple[GenerateOutput, GenerateOutput]:
        async with _client(fake) as client:
            await client.update_weight_version(1)
            push = client.weight_broadcast()
            assert push.push_clients() == (client,)
            await push.init_weights_update_group(
                master_address="10.0.0.1", master_port=29555, rank_offsets=[1], world_size=3, group_name="g"
            )
            before = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 5})
            for k, b in enumerate(buckets):
                await push.update_weights_from_distributed(
                    names=b["names"],
                    dtypes=b["dtype_names"],
                    shapes=b["shapes"],
                    version=2,
                    group_name="g",
                    last_bucket=k == len(buckets) - 1,
                )
                assert fake.updating == (k == 0)  # open between the buckets, finished after the last
            after = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 5})
            await push.destroy_weights_update_group("g")
            return before, after

    before, after = run_virtual(main())
    assert fake.transfer_group is None
    init = next(b for p, b in fake.calls if p == "/init_weight_transfer_engine")["init_info"]
    assert init == {
        "master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 3, "packed": False
    }  # fmt: skip
    assert fake.received == buckets
    paths = [p for p, _ in fake.calls if p != "/v1/completions"]
    i = paths.index("/start_weight_update")
    assert paths[i - 1] == "/pause"
    assert paths[i : i + 4] == [
        "/start_weight_update",
        "/update_weights",
        "/update_weights",
        "/finish_weight_update",
    ]
    assert paths[i + 4 :].index("/update_weight_version") < paths[i + 4 :].index("/resume")
    assert fake.weights == 1  # one update
    _assert_versions_exact(before, {0: 1})
    _assert_versions_exact(after, {1: 2})
    assert fake.version == "2"


def test_an_update_a_failed_broadcast_left_open_is_finished_before_the_disk_push() -> None:
    """The trainer's broadcast failed after the first bucket: the push goes by disk, and vLLM's loaders
    must not stay wrapped for the half-done update, so the reload finishes it first."""
    fake = FakeVLLMServer()

    async def main() -> None:
        async with _client(fake) as client:
            await _join(client)
            await client.pause_generation("retract")
            await client.update_weights_from_distributed(
                names=["a"], dtypes=["float32"], shapes=[[1]], version=3, last_bucket=False
            )
            assert fake.updating
            await client.update_weights_from_disk("/w/3", version=3)
            await client.continue_generation()

    run_virtual(main())
    paths = [p for p, _ in fake.calls]
    assert paths.index("/finish_weight_update") < paths.index("/collective_rpc")
    assert not fake.updating and fake.loaded == ["/w/3"] and fake.version == "3"


def _transfer_state(fake: FakeVLLMServer) -> tuple[str | None, bool]:
    """(the server's pause mode, whether an update is open on it)."""
    return fake.paused, fake.updating


@pytest.mark.vtime
def test_a_failed_update_keeps_its_own_pause_until_an_update_succeeds() -> None:
    """A bucket fails on a server the update itself paused (no controller pause): the server stays paused,
    so nothing generates on half-loaded weights stamped with the old version; the disk push that follows
    finishes the open update, loads, stamps and only then resumes. Waiting generations carry the new
    version on every token."""
    fake = FakeVLLMServer()

    async def main() -> GenerateOutput:
        async with _client(fake) as client:
            await client.update_weight_version(1)
            await _join(client)
            fake.fail_status["/update_weights"] = 500
            with pytest.raises(EngineUnavailable):
                await client.update_weights_from_distributed(
                    names=["a"], dtypes=["float32"], shapes=[[1]], version=2, last_bucket=True
                )
            del fake.fail_status["/update_weights"]
            assert _transfer_state(fake) == ("keep", True)
            async with asyncio.TaskGroup() as tg:
                waiting = tg.create_task(
                    client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4})
                )
                await asyncio.sleep(5.0)
                assert not any(p == "/v1/completions" for p, _ in fake.calls)
                await client.update_weights_from_disk("/w/2", version=2)
            assert _transfer_state(fake) == (None, False)
            return waiting.result()

    out = run_virtual(main())
    assert out.weight_versions == [2] * 4
    paths = [p for p, _ in fake.calls]
    assert paths.index("/finish_weight_update") < paths.index("/collective_rpc") < paths.index("/resume")


@pytest.mark.vtime
def test_a_failed_finish_is_not_resumed_and_the_routers_resume_ends_an_open_update() -> None:
    """Finishing the update fails: still paused. A resume (the router's probe of the excluded engine does
    one) finishes the open update before it lets generations go."""
    fake = FakeVLLMServer()

    async def main() -> None:
        async with _client(fake) as client:
            await _join(client)
            fake.fail_status["/update_weight_version"] = 500
            with pytest.raises(EngineUnavailable):
                await client.update_weights_from_distributed(
                    names=["a"], dtypes=["float32"], shapes=[[1]], version=2, last_bucket=True
                )
            assert _transfer_state(fake) == ("keep", False)
            del fake.fail_status["/update_weight_version"]
            await client.update_weights_from_distributed(
                names=["a"], dtypes=["float32"], shapes=[[1]], version=3, last_bucket=False
            )
            assert _transfer_state(fake) == ("keep", True)
            await client.continue_generation()
            assert _transfer_state(fake) == (None, False)

    run_virtual(main())


@pytest.mark.vtime
def test_a_server_still_in_a_group_leaves_it_before_joining_the_next() -> None:
    """After a failed broadcast nobody asks the server to leave the old group (the trainer dropped it);
    vLLM's init would replace the old NCCL communicator without destroying it, so the client asks
    `/shutdown_weight_transfer_engine` first. The transfer routes are never asked twice after a cut
    connection (a second /update_weights would wait for a broadcast nobody sends)."""
    fake = FakeVLLMServer()

    async def main() -> None:
        async with _client(fake) as client:
            await client.pause_generation("retract")
            await _join(client)
            fake.disconnects = 1
            with pytest.raises(EngineUnavailable, match="RemoteProtocolError"):
                await client.update_weights_from_distributed(
                    names=["a"], dtypes=["float32"], shapes=[[1]], version=2, last_bucket=False
                )
            await _join(client)
            await _join(client)

    run_virtual(main())
    paths = [p for p, _ in fake.calls]
    assert fake.leaked_groups == 0
    assert paths.count("/start_weight_update") == 1 and "/update_weights" not in paths
    assert paths.count("/shutdown_weight_transfer_engine") == 2
    assert paths.index("/finish_weight_update") < paths.index("/shutdown_weight_transfer_engine")


def test_broadcast_to_vllm_refuses_gloo_and_reports_an_unconfigured_server() -> None:
    """gloo (a CPU trainer) is refused before the server is asked; a server started without
    `--weight-transfer-config` answers vLLM's own error, raised as EngineUnavailable (a 5xx)."""
    fake = FakeVLLMServer()
    fake.weight_transfer = False

    async def main() -> None:
        async with _client(fake) as client:
            with pytest.raises(EngineBadResponse, match="NCCL only"):
                await _join(client, backend="gloo")
            assert not fake.calls
            with pytest.raises(EngineUnavailable, match="Weight transfer not configured"):
                await _join(client)

    run_virtual(main())


@pytest.mark.pure
def test_the_trainer_forms_vllms_own_group_for_vllm_servers_only() -> None:
    """Rank 0 joins vLLM servers through vLLM's NCCL rendezvous and every other server through
    torch.distributed (SGLang's protocol); no group can mix them, or be vLLM's with gloo (the push goes by
    disk)."""
    from miles_aio.trainer.actor import _group_protocol

    assert _group_protocol(["vllm", "vllm"], "nccl") == "vllm"
    assert _group_protocol([None, "miles_aio-embedded"], "gloo") == "torch"
    with pytest.raises(ValueError, match="cannot hold vLLM and other"):
        _group_protocol(["vllm", None], "nccl")
    with pytest.raises(ValueError, match="NCCL only"):
        _group_protocol(["vllm"], "gloo")


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


_ONE_TOKEN = '{"id": "c", "choices": [{"index": 0, "text": "x", "token_ids": [7], "finish_reason": null, "logprobs": {"token_logprobs": [-0.1]}}]}'  # noqa: E501
_USAGE = '{"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}'


@pytest.mark.parametrize(
    ("body", "outcome"),
    [
        (_sse(_USAGE, "[DONE]"), "abort"),  # vLLM sends no chunk for a request aborted before its first token
        (
            _sse(
                _ONE_TOKEN,
                _ONE_TOKEN.replace("null", '"length"').replace("[7]", "[]").replace("[-0.1]", "[]"),
                "[DONE]",
            ),
            "length",
        ),
        (_sse(_ONE_TOKEN, "[DONE]"), "[DONE] before a chunk with a finish reason"),
        (_sse(_ONE_TOKEN), "the stream ended before"),
        (_sse('{"error": {"message": "boom", "code": 400}}', "[DONE]"), "HTTP 400: boom"),
        (_sse(_ONE_TOKEN.replace("[-0.1]", "[-0.1, -0.2]")), "1 token_ids but logprobs"),
    ],
)
def test_streamed_answers_are_joined_or_refused(body: bytes, outcome: str) -> None:
    """What vLLM's SSE stream can end with: an abort with no token, a last chunk with the finish
    reason, and the broken ones (no finish, no [DONE], an error chunk, mismatched logprobs)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "3"})
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    got: list[GenerateChunk] = []

    async def sink(chunk: GenerateChunk) -> None:
        got.append(chunk)

    async def main() -> GenerateOutput:
        async with VLLMClient("http://fake-vllm", transport=httpx.MockTransport(handle)) as client:
            return await client.generate_stream(
                input_ids=PROMPT, sampling_params={"max_new_tokens": 4}, on_chunk=sink
            )

    if outcome in ("abort", "length"):
        out = run_virtual(main())
        assert out.finish_reason == outcome
        assert [t for c in got for t in c.output_ids] == out.output_ids
        assert all(c.weight_versions == [3] * len(c.output_ids) for c in got)
    else:
        with pytest.raises((EngineBadResponse, EngineUnavailable), match=re.escape(outcome)):
            run_virtual(main())

"""The client's contract with real servers: the embedded engine, a real SGLang server when
`MILES_AIO_SGLANG_URL` is set (plus `MILES_AIO_SGLANG_API_KEY` if it needs one), and the stub (to keep
the fake honest). Every `/generate` request the client sends and every answer it gets is checked against
SGLang's own schema (`sglang/api/v1/api_types.py`, loaded by file path; skipped without sglang).

Against a real SGLang server these tests stamp weight versions and pause/continue it: use a scratch one.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from miles_aio.inference.client import AiohttpTransport, SGLangClient
from miles_aio.testing.sglang_stub_server import load_sglang_api_types

pytestmark = [pytest.mark.procs, pytest.mark.timeout(60)]

SGLANG_URL_ENV = "MILES_AIO_SGLANG_URL"
PROMPT = [5, 6, 7, 8]


class RecordingTransport(httpx.AsyncBaseTransport):
    """The client's real transport, keeping every exchange for schema checks afterwards."""

    def __init__(self) -> None:
        self.inner = AiohttpTransport()
        self.exchanges: list[tuple[httpx.Request, httpx.Response]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        self.exchanges.append((request, response))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def api_types() -> ModuleType:
    module = load_sglang_api_types()
    if module is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang): cannot check SGLang's schema")
    return module


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    cmd = [
        sys.executable,
        "-m",
        "miles_aio.testing.sglang_stub_server",
        "--port",
        "0",
        "--token-latency-s",
        "0.002",
        "--check-schema",
    ]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        try:
            ready = json.loads(proc.stdout.readline())
            yield f"http://{ready['host']}:{ready['port']}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            proc.stdout.close()


@pytest.fixture(scope="module")
def embedded_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        from miles_aio.models import build_tiny_llama
        from tests.engine.helpers import ALPHABET, EngineProcess
    except ImportError as e:  # pragma: no cover - only while the embedded engine is not there
        pytest.skip(f"embedded engine not available: {e}")
    model = build_tiny_llama(tmp_path_factory.mktemp("contract") / "m", alphabet=ALPHABET, seed=0)
    proc = EngineProcess(model, log_dir=tmp_path_factory.mktemp("contract-logs"))
    yield proc.url
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture(params=["stub", "embedded", "sglang"])
def server(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """(URL, api key) of the server under test."""
    if request.param == "sglang":
        url = os.environ.get(SGLANG_URL_ENV)
        if not url:
            pytest.skip(
                f"set {SGLANG_URL_ENV}=http://host:port to run the contract against a real SGLang server"
            )
        return url, os.environ.get("MILES_AIO_SGLANG_API_KEY")
    return request.getfixturevalue(f"{request.param}_url"), None


def check_exchanges(api_types: ModuleType, transport: RecordingTransport) -> int:
    """Validate every /generate request and answer with SGLang's schema; return how many there were."""
    n = 0
    for request, response in transport.exchanges:
        if Path(request.url.path).name != "generate":
            continue
        n += 1
        body = json.loads(request.content)
        api_types.GenerateRequest.from_json_value(body)  # raises JsonContractError (SGLang's 400)
        assert body["return_logprob"] is True
        assert body["stream"] is False
        assert body["rid"]
        decoded = api_types.GenerateResponse.from_json_value(json.loads(response.content))
        finish = decoded.meta_info.finish_reason
        assert isinstance(finish, api_types.FinishStop | api_types.FinishLength | api_types.FinishAbort), (
            finish
        )
        entries = decoded.meta_info.output_token_logprobs
        assert entries is not None
        assert [e.token_id for e in entries] == decoded.output_ids
    return n


def test_generate_and_control_plane(server: tuple[str, str | None], api_types: ModuleType) -> None:
    url, api_key = server

    async def main() -> None:
        transport = RecordingTransport()
        async with SGLangClient(url, api_key=api_key, transport=transport) as client:
            await client.health_generate()
            api_types.GetModelInfoResponse.from_json_value(await client.model_info())
            assert isinstance(await client.server_info(), dict)
            greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
            out = await client.generate(input_ids=PROMPT, sampling_params=greedy, routing_key=3)
            assert len(out.output_ids) == 8
            assert out.finish_reason == "length"
            assert all(lp <= 0.0 for lp in out.output_log_probs)
            assert len(set(out.weight_versions)) == 1
            assert out.weight_versions[0] == await client.weight_version()
            first = out.output_ids[0]
            stop = await client.generate(
                input_ids=PROMPT,
                sampling_params={"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [first]},
            )
            assert stop.finish_reason == "stop"
            assert stop.output_ids == [first]
            version = 7_000 + os.getpid() % 1000
            await client.update_weight_version(version)
            assert await client.weight_version() == version
            again = await client.generate(input_ids=PROMPT, sampling_params=greedy)
            assert again.weight_versions == [version] * 8
            if url != os.environ.get(SGLANG_URL_ENV):  # a GPU server's greedy decoding may vary with batching
                assert again.output_ids == out.output_ids  # a version stamp changes no weights
            await client.pause_generation("retract")
            await client.continue_generation()
            await client.flush_cache()
            await client.abort_request(rid="no-such-request")
        assert check_exchanges(api_types, transport) == 3

    asyncio.run(main())


def test_embedded_engine_cached_tokens_reach_the_sample(embedded_url: str) -> None:
    """The embedded engine reports `meta_info.cached_tokens` as SGLang does, and a sample sums them over
    its calls: the second turn re-sends prompt + first response, which the prefix cache holds."""
    from miles_aio.types import Sample

    async def main() -> tuple[Sample, Sample]:
        async with SGLangClient(embedded_url) as client:
            greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            cold = Sample(group_index=0, index=0, prompt="p", tokens=[9, 10, 11, 12, 13, 14])
            cold.append(await client.generate(input_ids=cold.tokens, sampling_params=greedy))
            warm = Sample(group_index=0, index=1, prompt="p", tokens=[9, 10, 11, 12, 13, 14])
            warm.append(await client.generate(input_ids=warm.tokens, sampling_params=greedy))
            first = warm.cached_tokens
            warm.append(await client.generate(input_ids=warm.tokens, sampling_params=greedy))
            assert warm.cached_tokens > first
            return cold, warm

    cold, warm = asyncio.run(main())
    assert cold.cached_tokens == 0
    assert warm.cached_tokens >= 5 + 5  # the last prompt token is always fed, so at most len - 1 a call


def test_partial_rollout_continues_an_aborted_generation(
    server: tuple[str, str | None], api_types: ModuleType
) -> None:
    url, api_key = server
    budget = 200

    async def main() -> None:
        transport = RecordingTransport()
        async with SGLangClient(url, api_key=api_key, transport=transport, partial_rollout=True) as client:
            before = 8_000 + os.getpid() % 1000
            await client.update_weight_version(before)
            params = {"max_new_tokens": budget, "temperature": 1.0, "ignore_eos": True}
            try:
                async with asyncio.TaskGroup() as tg:
                    task = tg.create_task(client.generate(input_ids=PROMPT, sampling_params=params))
                    await asyncio.sleep(0.1)
                    await client.pause_generation("abort")
                    await client.update_weight_version(before + 1)
                    await client.continue_generation()
            finally:
                await client.continue_generation()  # never leave a shared server paused
            out = task.result()
        assert out.finish_reason == "length"
        assert len(out.output_ids) == budget
        assert len(out.output_log_probs) == budget
        k = out.weight_versions.count(before)
        # Every token produced before the pause is tagged `before`, every later one `before + 1`.
        assert out.weight_versions == [before] * k + [before + 1] * (budget - k)
        n = check_exchanges(api_types, transport)
        assert n == out.meta.get("partial_rollout_segments", 1)
        assert n in (1, 2)
        if n == 2:  # the pause landed mid-generation (nearly always): the continuation resubmitted the rest
            assert 0 < k < budget
            assert client.continuations == 1
            generates = [
                json.loads(r.content) for r, _ in transport.exchanges if r.url.path.endswith("/generate")
            ]
            assert generates[1]["input_ids"] == PROMPT + out.output_ids[:k]
            assert generates[1]["sampling_params"]["max_new_tokens"] == budget - k

    asyncio.run(main())

"""The engine contract, one suite for every engine behind the controller's engine protocol: the embedded
engine (through `SGLangClient`) always, and a real vLLM server (through `VLLMClient`) when one is given:

  MILES_AIO_VLLM_URL=http://127.0.0.1:PORT    a running server (started with VLLM_SERVER_DEV_MODE=1);
      MILES_AIO_VLLM_MODEL, MILES_AIO_VLLM_OTHER_MODEL: the dir it serves and one of the same shape with
      other weights (for the weight-reload test, skipped without them)
  MILES_AIO_VLLM_LAUNCH=1                     start one here on a tiny Llama (`nox -s vllm` does)

What every engine must do the same way: generate from token ids with logprobs, stop on token ids, stamp
versions, pause (abort / retract) mid-generation and continue with every token's policy version exact,
load weights from disk (and back, to the same greedy tokens), flush. Against a given server these tests
stamp versions, pause it and load weights: use a scratch one.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_aio.inference.base import GenerateChunk, PauseMode
from miles_aio.inference.client import SGLangClient
from miles_aio.inference.vllm import VLLMClient
from miles_aio.types import GenerateOutput

pytestmark = [pytest.mark.procs, pytest.mark.timeout(900)]  # a cold vLLM start takes minutes

VLLM_URL_ENV = "MILES_AIO_VLLM_URL"
VLLM_LAUNCH_ENV = "MILES_AIO_VLLM_LAUNCH"
PROMPT = [5, 6, 7, 8]
BUDGET = 240  # long enough to be mid-generation at the pause, within a 256-token context
# vLLM's CPU attention needs head_dim 64: hidden 128 over 2 heads (the embedded engine takes any)
SHAPE: dict[str, Any] = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 2}


@dataclass(frozen=True)
class Target:
    """One engine under test: where it serves, what it serves, and the client that speaks to it."""

    name: str
    url: str
    model: Path | None
    other: Path | None
    connect: Callable[..., SGLangClient | VLLMClient]


def _tiny(root: Path, seed: int) -> Path:
    from miles_aio.models import build_tiny_llama
    from tests.engine.helpers import ALPHABET

    return build_tiny_llama(root / f"m{seed}", alphabet=ALPHABET, seed=seed, **SHAPE)


@pytest.fixture(scope="module")
def embedded_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    from tests.engine.helpers import EngineProcess

    root = tmp_path_factory.mktemp("protocol-embedded")
    m0, m1 = _tiny(root, 0), _tiny(root, 1)
    proc = EngineProcess(m0, "--weights-root", str(root), log_dir=root)
    yield Target("embedded", proc.url, m0, m1, SGLangClient)
    assert proc.stop() == 0, proc.stderr()


def _wait_health(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)  # the server offers nothing to wait on until it listens
    raise RuntimeError(f"vLLM not healthy after {timeout_s} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if url := os.environ.get(VLLM_URL_ENV):
        model, other = os.environ.get("MILES_AIO_VLLM_MODEL"), os.environ.get("MILES_AIO_VLLM_OTHER_MODEL")
        yield Target("vllm", url, Path(model) if model else None, Path(other) if other else None, VLLMClient)
        return
    if os.environ.get(VLLM_LAUNCH_ENV) != "1":
        pytest.skip(f"set {VLLM_URL_ENV}=http://host:port or {VLLM_LAUNCH_ENV}=1 to run against real vLLM")
    from miles_aio.inference.server_launch import free_port
    from miles_aio.inference.vllm_launch import vllm_command, vllm_env

    root = tmp_path_factory.mktemp("protocol-vllm")
    m0, m1 = _tiny(root, 0), _tiny(root, 1)
    port = free_port()
    cmd = vllm_command(str(m0), host="127.0.0.1", port=port, tp_size=1, extra_args=["--max-model-len", "256"])
    env = vllm_env({**os.environ, "HF_HUB_OFFLINE": "1"})
    log = root / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, proc, log, timeout_s=600)
        yield Target("vllm", url, m0, m1, VLLMClient)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(params=["embedded", "vllm"])
def target(request: pytest.FixtureRequest) -> Target:
    t: Target = request.getfixturevalue(f"{request.param}_target")
    return t


def _greedy(n: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **extra}


def _check_split(out: GenerateOutput, before: int, after: int, budget: int) -> int:
    """Every token before the pause is `before`, every later one `after`; returns how many came before."""
    assert out.finish_reason == "length"
    assert len(out.output_ids) == len(out.output_log_probs) == budget
    k = out.weight_versions.count(before)
    assert out.weight_versions == [before] * k + [after] * (budget - k), out.weight_versions
    assert all(lp <= 0.0 for lp in out.output_log_probs)
    return k


def test_generate_stop_and_version_stamps(target: Target) -> None:
    async def main() -> None:
        async with target.connect(target.url) as client:
            await client.health_generate()
            info = await client.server_info()
            assert isinstance(info, dict)
            out = await client.generate(input_ids=PROMPT, sampling_params=_greedy(8))
            assert len(out.output_ids) == len(out.output_log_probs) == 8
            assert out.finish_reason == "length"
            assert out.prompt_tokens == len(PROMPT)
            assert all(lp <= 0.0 for lp in out.output_log_probs)
            assert out.weight_versions == [await client.weight_version()] * 8
            first = out.output_ids[0]
            stop = await client.generate(
                input_ids=PROMPT,
                sampling_params={"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [first]},
            )
            assert (stop.finish_reason, stop.output_ids) == ("stop", [first])
            version = 7_000 + os.getpid() % 1000
            await client.update_weight_version(version)
            assert await client.weight_version() == version
            again = await client.generate(input_ids=PROMPT, sampling_params=_greedy(8))
            assert again.weight_versions == [version] * 8
            assert again.output_ids == out.output_ids  # a version stamp changes no weights
            chunks: list[GenerateChunk] = []

            async def sink(chunk: GenerateChunk) -> None:
                chunks.append(chunk)

            streamed = await client.generate_stream(
                input_ids=PROMPT, sampling_params=_greedy(8), on_chunk=sink
            )
            assert (streamed.output_ids, streamed.finish_reason) == (out.output_ids, "length")
            assert streamed.output_log_probs == pytest.approx(out.output_log_probs, abs=1e-4)
            assert [t for c in chunks for t in c.output_ids] == streamed.output_ids
            assert [v for c in chunks for v in c.weight_versions] == [version] * 8
            await client.flush_cache()

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_pause_mid_generation_keeps_every_tokens_version_exact(
    target: Target, mode: PauseMode, stream: bool
) -> None:
    """Four generations in flight; pause, stamp a new version, continue: each finishes its whole budget
    (abort: by partial rollout; retract: the engine keeps them), every token tagged with the version
    that produced it. Streamed, the chunks carry the same versions and join to the output."""
    before = 8_000 + os.getpid() % 1000
    chunks: dict[int, list[GenerateChunk]] = {i: [] for i in range(4)}

    async def one(client: SGLangClient | VLLMClient, i: int, params: dict[str, Any]) -> GenerateOutput:
        if not stream:
            return await client.generate(input_ids=[*PROMPT, i], sampling_params=params)

        async def sink(chunk: GenerateChunk) -> None:
            chunks[i].append(chunk)

        return await client.generate_stream(input_ids=[*PROMPT, i], sampling_params=params, on_chunk=sink)

    async def main() -> list[GenerateOutput]:
        async with target.connect(target.url, partial_rollout=mode == "abort") as client:
            await client.update_weight_version(before)
            params = {"max_new_tokens": BUDGET, "temperature": 1.0, "ignore_eos": True}
            try:
                started = asyncio.Event()

                async def probe(chunk: GenerateChunk) -> None:
                    started.set()

                async with asyncio.TaskGroup() as tg:
                    tasks = [tg.create_task(one(client, i, params)) for i in range(4)]
                    # A fifth, streamed generation says when decoding has begun: a fixed sleep came
                    # after all 240 tokens on a quiet machine and before the first on a loaded one.
                    tg.create_task(
                        client.generate_stream(input_ids=[*PROMPT, 9], sampling_params=params, on_chunk=probe)
                    )
                    await started.wait()
                    await asyncio.sleep(0.02)
                    await client.pause_generation(mode)
                    await client.update_weight_version(before + 1)
                    await client.continue_generation()
            finally:
                await client.continue_generation()  # never leave a shared server paused
            return [t.result() for t in tasks]

    outs = asyncio.run(main())
    ks = [_check_split(out, before, before + 1, BUDGET) for out in outs]
    assert any(0 < k < BUDGET for k in ks), ks  # the pause landed mid-generation
    if stream:
        for i, out in enumerate(outs):
            assert [t for c in chunks[i] for t in c.output_ids] == out.output_ids
            assert [v for c in chunks[i] for v in c.weight_versions] == out.weight_versions


def test_abort_pause_without_partial_rollout_returns_what_was_made(target: Target) -> None:
    before = 9_000 + os.getpid() % 1000

    async def main() -> list[GenerateOutput]:
        async with target.connect(target.url) as client:
            await client.update_weight_version(before)
            params = {"max_new_tokens": BUDGET, "temperature": 1.0, "ignore_eos": True}
            try:
                started = asyncio.Event()

                async def probe(chunk: GenerateChunk) -> None:
                    started.set()

                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        tg.create_task(client.generate(input_ids=[*PROMPT, i], sampling_params=params))
                        for i in range(4)
                    ]
                    # pause once decoding has begun (a streamed probe's first chunk), not after a fixed
                    # sleep: on a quiet machine 0.2 s came after all 240 tokens
                    tg.create_task(
                        client.generate_stream(input_ids=[*PROMPT, 9], sampling_params=params, on_chunk=probe)
                    )
                    await started.wait()
                    await asyncio.sleep(0.02)
                    await client.pause_generation("abort")
                    outs = [await t for t in tasks]  # answered while the engine is still paused
                    await client.update_weight_version(before + 1)
            finally:
                await client.continue_generation()
            return outs

    outs = asyncio.run(main())
    assert any(out.finish_reason == "abort" for out in outs)
    for out in outs:
        assert len(out.output_log_probs) == len(out.output_ids)
        assert out.weight_versions == [before] * len(out.output_ids)
        n = len(out.output_ids)
        assert (out.finish_reason, n == BUDGET) in (("abort", False), ("length", True)), (
            out.finish_reason,
            n,
        )


def test_weights_from_disk_change_the_policy_and_load_back(target: Target) -> None:
    if target.model is None or target.other is None:
        pytest.skip("set MILES_AIO_VLLM_MODEL and MILES_AIO_VLLM_OTHER_MODEL to test weight reloads")
    model, other = target.model, target.other

    async def main() -> None:
        async with target.connect(target.url) as client:
            base = 10_000 + os.getpid() % 1000
            greedy = _greedy(12)

            async def load(path: Path, version: int) -> GenerateOutput:
                await client.pause_generation("retract")
                await client.flush_cache()
                await client.update_weights_from_disk(str(path), version=version, flush_cache=False)
                await client.continue_generation()
                assert await client.weight_version() == version
                out = await client.generate(input_ids=PROMPT, sampling_params=greedy)
                assert out.weight_versions == [version] * 12
                return out

            first = await load(model, base)  # whatever an earlier user left loaded
            changed = await load(other, base + 1)
            assert changed.output_log_probs != pytest.approx(first.output_log_probs, abs=1e-4)
            back = await load(model, base + 2)  # back on the first weights: the same tokens and logprobs
            assert back.output_ids == first.output_ids
            assert back.output_log_probs == pytest.approx(first.output_log_probs, abs=1e-4)

    asyncio.run(main())

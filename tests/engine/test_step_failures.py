"""A failing forward fails only the requests it must, and logs one line each; GRPO groups share prefill.

Real engine processes at realistic lengths (prompts of hundreds of tokens, hundreds of new tokens, tens
of requests in flight). Faults are injected with the engine's `MILES_AIO_ENGINE_FAULT_TOKEN` hook: every
forward step that feeds that token id raises, wherever the token is (a prompt, or a sampled token that
the next decode step feeds back).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_aio.models import build_tiny_llama
from tests.engine.helpers import ALPHABET, EngineProcess

pytestmark = pytest.mark.slow

FAULT = 7  # the token id the faulty engine refuses to feed
PROMPT = [3 + (i * 5) % 40 for i in range(300)]
assert FAULT not in PROMPT


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("long") / "m", alphabet=ALPHABET, hidden_size=64, max_position_embeddings=2048
    )


@pytest.fixture(scope="module")
def faulty(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = EngineProcess(
        long_model,
        "--max-running-requests",
        "64",
        log_dir=tmp_path_factory.mktemp("logs"),
        env={"MILES_AIO_ENGINE_FAULT_TOKEN": str(FAULT)},
    )
    yield proc
    assert proc.stop() == 0, proc.stderr()


def _body(prompt: list[int], new: int, seed: int, **sampling: Any) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "sampling_seed": seed, **sampling},
        "return_logprob": True,
    }


async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as c:
        return list(await asyncio.gather(*(c.post("/generate", json=b) for b in bodies)))


def test_a_failing_forward_fails_only_its_requests_and_the_engine_keeps_serving(
    faulty: EngineProcess,
) -> None:
    never_fault = {"logit_bias": {str(FAULT): -100.0}}
    good = [_body(PROMPT, 200 + 10 * i, seed=i, **never_fault) for i in range(16)]
    # Poisoned at prefill (the prompt holds the token) and at decode (its first sampled token is the
    # token: the next decode step, shared with every good request, feeds it).
    bad_prompt = [_body([*PROMPT[:150], FAULT, *PROMPT[150:]], 50, seed=100 + i) for i in range(2)]
    bad_decode = [
        _body(PROMPT, 50, seed=200 + i, logit_bias={str(FAULT): 100.0}, min_new_tokens=5) for i in range(2)
    ]
    answers = asyncio.run(_post_all(faulty.url, good + bad_prompt + bad_decode))

    for body, resp in zip(good, answers[:16], strict=True):
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert len(out["output_ids"]) == body["sampling_params"]["max_new_tokens"]
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert FAULT not in out["output_ids"]
    for resp in answers[16:]:
        assert resp.status_code == 500, resp.text
        assert "injected fault: token 7" in resp.json()["error"]["message"]

    # The engine is not wedged: it serves a long request afterwards.
    after = asyncio.run(_post_all(faulty.url, [_body(PROMPT * 3, 300, seed=9, **never_fault)]))[0]
    assert after.status_code == 200, after.text
    assert len(after.json()["output_ids"]) == 300

    log = faulty.stderr_path.read_text(errors="replace")
    assert log.count("engine.request_failed") == 4, log[-3000:]
    assert log.count("Traceback (most recent call last)") == 1, log[-3000:]  # the first failure only
    assert len(log) < 20_000, f"{len(log)} bytes of log for 4 failed requests"


def test_identical_prompts_prefill_once_and_match_a_cache_free_engine(
    long_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prompt = [3 + (i * 11) % 40 for i in range(400)]
    group = [_body(prompt, 120, seed=i) for i in range(8)]
    logs = tmp_path_factory.mktemp("share-logs")
    outs: dict[str, list[dict[str, Any]]] = {}
    for name, args in (("cache", ()), ("no-cache", ("--prefix-cache-entries", "0"))):
        proc = EngineProcess(long_model, "--max-running-requests", "16", *args, log_dir=logs)
        try:
            answers = asyncio.run(_post_all(proc.url, group))
        finally:
            assert proc.stop() == 0, proc.stderr()
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        outs[name] = [r.json() for r in answers]

    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs["cache"])
    assert cached == [0] + [len(prompt) - 1] * 7  # one prefill of the prompt, seven reuses
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs["no-cache"])
    for a, b in zip(outs["cache"], outs["no-cache"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
        lb = [e[0] for e in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4

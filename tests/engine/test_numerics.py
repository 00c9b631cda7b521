"""The engine computes what a trainer computes: logits/logprobs against transformers' LlamaForCausalLM.

Tolerance: 1e-4 absolute on log-probabilities (float32 on both sides; observed differences are ~1e-6).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

from miles_aio.engine.model import KVPool, LlamaModel
from tests.engine.helpers import (
    EngineProcess,
    Models,
    check_response,
    generate,
    hf_model,
    logprobs,
    reference_logprobs,
)

pytestmark = [pytest.mark.slow]

ATOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [3], [21, 22, 23, 24]]


def _hf_logprobs(model_path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(model_path)(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["m1", "tied"])
def test_forward_matches_transformers_prefill_and_decode(models: Models, which: str) -> None:
    """Prefill, token-by-token decode and a padded 2-row decode batch all match HF's full forward."""
    path = getattr(models, which)
    ids = [5, 9, 14, 3, 27, 31, 8, 12, 40, 2, 17]
    expected = _hf_logprobs(path, ids)
    model = LlamaModel.load(path, context_len=64)
    # Capacity 4: the pool grows (4 → 8 → 16) while decoding, which must not disturb the stored KV.
    kv = KVPool(model.spec, num_slots=3, context_len=64, dtype=torch.float32, initial_capacity=4)

    def step(rows: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """rows: (slot, tokens, start) with equal token counts; returns last-position logprobs."""
        positions = torch.tensor([list(range(s, s + len(t))) for _, t, s in rows])
        logits = model.forward(
            torch.tensor([t for _, t, _ in rows]),
            positions,
            slots=torch.tensor([r[0] for r in rows]),
            kv=kv,
            kv_len=int(positions.max()) + 1,
        )
        return torch.log_softmax(logits, dim=-1)

    # slot 0: prefill 4 tokens, then decode the rest one by one.
    got = [step([(0, ids[:4], 0)])[0]]
    for i in range(4, len(ids)):
        got.append(step([(0, [ids[i]], i)])[0])
    torch.testing.assert_close(torch.stack(got), expected[3:], atol=ATOL, rtol=0)
    assert kv.capacity == 16
    # slots 1 and 2: different lengths decoded together in one padded batch.
    step([(1, ids[:6], 0)])
    step([(2, ids[:2], 0)])
    both = step([(1, [ids[6]], 6), (2, [ids[2]], 2)])
    torch.testing.assert_close(both[0], expected[6], atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], expected[2], atol=ATOL, rtol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("params", "temperature"),
    [
        ({"temperature": 0.0}, 1.0),  # greedy reports log_softmax(logits), as SGLang
        ({"temperature": 1.0, "sampling_seed": 7}, 1.0),
        (
            {"temperature": 1.0, "top_p": 0.8, "top_k": 10, "sampling_seed": 8},
            1.0,
        ),  # truncation not reflected
        ({"temperature": 0.7, "sampling_seed": 9}, 0.7),  # tempered: log_softmax(logits / T)
    ],
)
def test_rollout_logprobs_equal_trainer_logprobs(
    client: httpx.Client, api_types: ModuleType, models: Models, params: dict[str, Any], temperature: float
) -> None:
    body = {
        "input_ids": PROMPTS[0],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **params},
    }
    data = generate(client, api_types, body)
    ref = reference_logprobs(models.m1, PROMPTS[0], data["output_ids"], temperature=temperature)
    assert logprobs(data) == pytest.approx(ref, abs=ATOL)


async def _generate_all(url: str, bodies: list[dict[str, Any]], *, stagger_s: float) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:

        async def one(i: int, body: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(i * stagger_s)  # later requests join a batch that is already decoding
            resp = await client.post("/generate", json=body)
            assert resp.status_code == 200, resp.text
            data: dict[str, Any] = resp.json()
            return data

        return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))


@pytest.mark.timeout(60)
def test_continuous_batching_matches_one_by_one(
    client: httpx.Client, api_types: ModuleType, engine: EngineProcess
) -> None:
    bodies = [
        {
            "input_ids": p,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 20 + 3 * i,
                "temperature": 0.0 if i % 2 else 1.0,
                "sampling_seed": i,
                "ignore_eos": True,
            },
        }
        for i, p in enumerate(PROMPTS * 2)
    ]
    alone = [generate(client, api_types, b) for b in bodies]
    client.post("/slow_down", json={"forward_sleep_time": 0.005})
    try:
        together = asyncio.run(_generate_all(engine.url, bodies, stagger_s=0.02))
    finally:
        client.post("/slow_down", json={"forward_sleep_time": None})
    for a, b in zip(alone, together, strict=True):
        check_response(api_types, b)
        assert b["output_ids"] == a["output_ids"]
        assert logprobs(b) == pytest.approx(logprobs(a), abs=ATOL)


@pytest.mark.timeout(60)
def test_prefix_cache_reuses_prompt_kv_exactly(client: httpx.Client, api_types: ModuleType) -> None:
    prompt = [30, 31, 32, 33, 34, 35, 36, 37]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.0},
    }
    assert client.post("/flush_cache").status_code == 200
    first = generate(client, api_types, body)
    second = generate(client, api_types, body)
    longer = generate(client, api_types, {**body, "input_ids": [*prompt, 38, 39]})
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(prompt) - 1  # the last prompt token is always fed
    assert longer["meta_info"]["cached_tokens"] == len(prompt)
    assert second["output_ids"] == first["output_ids"]
    assert logprobs(second) == pytest.approx(logprobs(first), abs=ATOL)

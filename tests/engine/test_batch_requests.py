"""The embedded engine answering `SGLangClient(batch_generate=True)`: a group's calls batched into one
`/generate` give, call by call, what the same calls give sent alone (greedy, and seeded sampling), at
prompt lengths of a couple of hundred tokens with a shared prefix (a GRPO group's shape)."""

from __future__ import annotations

import asyncio
import random

import pytest

from miles_aio.errors import EngineBadResponse
from miles_aio.inference.client import SGLangClient
from miles_aio.types import GenerateOutput
from tests.engine.helpers import ALPHABET, EngineProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

VOCAB_LO, VOCAB_HI = 3, 3 + len(ALPHABET)  # the alphabet's ids; 0-2 are <pad> <s> </s>


async def _calls(
    client: SGLangClient, prompts: list[list[int]], params: list[dict[str, object]]
) -> list[GenerateOutput]:
    return list(
        await asyncio.gather(
            *(
                client.generate(input_ids=p, sampling_params=sp, routing_key="group-0")
                for p, sp in zip(prompts, params, strict=True)
            )
        )
    )


def test_a_batched_group_answers_what_each_call_answers_alone(engine: EngineProcess) -> None:
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(150)]  # the group's common prompt
    prompts = [shared + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(k * 5)] for k in range(8)]
    params: list[dict[str, object]] = [
        {"max_new_tokens": 48, "temperature": 0.0}
        if k % 2 == 0
        else {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": 1000 + k}
        for k in range(8)
    ]

    async def main() -> tuple[list[GenerateOutput], list[GenerateOutput], int]:
        async with SGLangClient(engine.url, batch_generate=True) as batched:
            together = await _calls(batched, prompts, params)
            n_batched = batched.batched_requests
        async with SGLangClient(engine.url) as plain:
            alone = [await _calls(plain, [p], [sp]) for p, sp in zip(prompts, params, strict=True)]
        return together, [a[0] for a in alone], n_batched

    together, alone, n_batched = asyncio.run(main())
    assert n_batched == 1
    for k, (t, a) in enumerate(zip(together, alone, strict=True)):
        assert t.prompt_tokens == len(prompts[k])
        assert t.output_ids == a.output_ids, f"call {k}"
        assert len(t.output_ids) > 0
        assert t.output_log_probs == pytest.approx(a.output_log_probs, abs=1e-4)


def test_one_prompt_over_the_context_fails_alone_its_siblings_are_answered(engine: EngineProcess) -> None:
    rng = random.Random(8)
    prompts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(120)] for _ in range(4)]
    prompts[2] = prompts[2] * 3  # 360 tokens: past the model's 256 positions, SGLang's 400

    async def main() -> list[GenerateOutput | BaseException]:
        async with SGLangClient(engine.url, batch_generate=True) as client:
            calls = [
                client.generate(input_ids=p, sampling_params={"max_new_tokens": 16}, routing_key="g")
                for p in prompts
            ]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    outs = asyncio.run(main())
    assert isinstance(outs[2], EngineBadResponse) and "context length" in str(outs[2])
    for k in (0, 1, 3):
        out = outs[k]
        assert isinstance(out, GenerateOutput), out
        assert len(out.output_ids) == 16

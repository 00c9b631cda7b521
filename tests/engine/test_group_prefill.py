"""A GRPO group's prompt is prefilled once and cached once, short prompts included.

The embedded engine defers the other samples of an uncached prompt by one step (SGLang's in-batch prefix
caching), for every prompt of 2 tokens and more; SGLang's 32-token threshold
(`IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD=32`) leaves shorter prompts prefilled by every sample,
which still save one copy of the prompt's keys/values per step, not one per sample.

In process: the real scheduler (`LocalEngine`) and runner on a tiny Llama; a group of 8 samples of a
300-token prompt and one of a 6-token prompt, queued before the scheduler's first step; the runner
records what each step saved."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from miles_aio.engine import core
from miles_aio.engine.core import LocalEngine, Request
from miles_aio.engine.model import LlamaModel
from miles_aio.engine.runner import ModelRunner, StepPlan, StepResult
from miles_aio.engine.sampling import SamplingParams
from miles_aio.models import build_tiny_llama
from tests.engine.helpers import ALPHABET

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]

PROMPTS = [[3 + (i * 5) % 40 for i in range(300)], [4, 9, 3, 12, 7, 5]]
N = 8


class SaveRecordingRunner(ModelRunner):
    """The real runner; records, per step, the prompt lengths its prefill rows were asked to save."""

    saves: list[list[int]]

    def step(self, plan: StepPlan) -> StepResult:
        self.saves.append([r.save_prefix for r in plan.prefills if r.save_prefix])
        return super().step(plan)


@pytest.mark.parametrize("threshold", [2, 32])
def test_a_group_prefills_its_prompt_once_and_caches_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threshold: int
) -> None:
    monkeypatch.setattr(core, "_SHARE_MIN_TOKENS", threshold)
    model_dir = build_tiny_llama(
        tmp_path / "m", alphabet=ALPHABET, hidden_size=64, max_position_embeddings=512
    )
    model = LlamaModel.load(model_dir, context_len=512)
    runner = SaveRecordingRunner(model, max_running=2 * N, context_len=512)
    runner.saves = []

    async def main() -> tuple[list[int], list[int], int]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            engine = LocalEngine(
                runner,
                executor=pool,
                detokenize=lambda ids: "",
                context_len=512,
                weight_version="1",
                prefix_cache_entries=16,
                seed=0,
            )

            def request(rid: str, prompt: list[int]) -> asyncio.Task[Request]:
                params = SamplingParams(max_new_tokens=16, ignore_eos=True, sampling_seed=len(rid))
                req = engine.new_request(rid=rid, prompt_ids=prompt, params=params)
                return asyncio.ensure_future(engine.generate(req))

            group = [request(f"g{g}-{i}", p) for g, p in enumerate(PROMPTS) for i in range(N)]
            async with asyncio.TaskGroup() as tg:
                tg.create_task(engine.run(), name="engine")
                await asyncio.gather(*group)
                late = engine.new_request(
                    rid="late", prompt_ids=PROMPTS[0], params=SamplingParams(max_new_tokens=1)
                )
                await engine.generate(late)  # the cache holds the group's prompt
                engine.close()
            done = [t.result() for t in group]
            return [len(r.output_ids) for r in done], [r.cached_tokens for r in done], late.cached_tokens

    lengths, cached, late_cached = asyncio.run(main())
    assert lengths == [16] * (2 * N)
    assert runner.saves[0] == [300, 6]  # one copy of each prompt, however many rows prefilled it
    assert all(s == [] for s in runner.saves[1:])
    # the first sample of a group computes its prompt; the others start from its KV (all but the last
    # position, which is fed) unless the prompt is below the threshold: then each computes it
    assert cached[:N] == [0] + [299] * (N - 1)
    assert cached[N:] == ([0] + [5] * (N - 1) if threshold <= 6 else [0] * N)
    assert late_cached == 299

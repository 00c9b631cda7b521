"""The rollout page's example reward scores what the quickstart's engine actually returns."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from miles_aio.data.source import encode_prompt
from miles_aio.engine.protocol import parse_sampling_params
from miles_aio.rollout.pool import sampling_params_from_config
from miles_aio.tasks.arithmetic import ALPHABET, answer_reward, make_splits
from miles_aio.types import GenerateOutput, Sample
from recipes import quickstart
from tests.docs._docs import DOCS, fenced_blocks
from tests.helpers import make_config


def page_reward() -> Any:
    """`reward` of the rollout page's runnable example, executed as the page shows it."""
    text = (DOCS / "guide" / "rollout.md").read_text(encoding="utf-8")
    code = next(c for c, runnable in fenced_blocks(text, "python") if runnable and "async def reward" in c)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    exec(compile(code, "docs/guide/rollout.md", "exec"), namespace)
    return namespace["reward"]


@pytest.fixture(scope="module")
def quickstart_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The quickstart model's tokenizer, loaded as the recipe loads it (AutoTokenizer)."""
    from transformers import AutoTokenizer

    from miles_aio.models.tiny import build_tiny_llama

    model = build_tiny_llama(
        tmp_path_factory.mktemp("qs") / "model",
        alphabet=ALPHABET,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
    )
    return AutoTokenizer.from_pretrained(model)


def quickstart_sample(tok: Any, tmp_path: Path, answer: str) -> Sample:
    """A sample as a quickstart run builds it: prompt ids, then an engine output `answer` + EOS whose
    text is decoded with the sampling params the quickstart's config sends."""
    problem = make_splits()[0][0]
    cfg = make_config(tmp_path / "run", **quickstart.DEFAULTS, save=tmp_path / "ckpt")
    params = parse_sampling_params(sampling_params_from_config(SimpleNamespace(config=cfg)))  # type: ignore[arg-type]
    sample = Sample(group_index=0, index=0, prompt=problem.prompt, label=problem.answer)
    sample.tokens = encode_prompt(tok, problem.prompt)
    ids = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
    text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)  # as the engine's handler does
    n = len(ids)
    out = GenerateOutput(
        text=text, output_ids=ids, output_log_probs=[0.0] * n, weight_versions=[1] * n, finish_reason="stop"
    )
    sample.append(out)
    return sample


def test_the_page_reward_scores_a_quickstart_answer(quickstart_tokenizer: Any, tmp_path: Path) -> None:
    reward = page_reward()
    label = make_splits()[0][0].answer
    right = quickstart_sample(quickstart_tokenizer, tmp_path, label)
    assert right.response.endswith(quickstart_tokenizer.eos_token)  # special tokens kept, as miles
    assert asyncio.run(reward(None, right)) == {"reward": 1.0, "accuracy": 1.0}
    assert asyncio.run(answer_reward(None, right)) == 1.0  # the quickstart's own reward agrees
    wrong = quickstart_sample(quickstart_tokenizer, tmp_path, str(int(label) + 1))
    assert asyncio.run(reward(None, wrong)) == {"reward": 0.0, "accuracy": 0.0}
    longer = quickstart_sample(quickstart_tokenizer, tmp_path, label + "0")
    assert asyncio.run(reward(None, longer))["reward"] == 0.0

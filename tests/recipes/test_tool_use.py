"""The tool-use rollout coroutine: turn structure and loss masks, against a scripted FAKE engine."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping
from typing import Any

import pytest
import structlog

from miles_aio.models.tiny import build_tiny_llama, load_tokenizer
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import GenerateOutput, Sample
from recipes.tool_use import ALPHABET, generate, reward
from tests.helpers import make_config

pytestmark = pytest.mark.pure


class ScriptedEngine:
    """A FAKE engine that answers each call with the next scripted text (one version per call)."""

    def __init__(self, tok: Any, replies: list[str]) -> None:
        self.tok, self.replies = tok, list(replies)
        self.calls: list[tuple[list[int], dict[str, Any]]] = []

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        self.calls.append((list(input_ids), dict(sampling_params)))
        text = self.replies.pop(0)
        ids = self.tok.encode(text)
        return GenerateOutput(
            text=text,
            output_ids=ids,
            output_log_probs=[-0.1] * len(ids),
            weight_versions=[len(self.calls)] * len(ids),
            finish_reason="stop",
        )


def run_tool_use(tmp_path: Any, replies: list[str]) -> tuple[Sample, ScriptedEngine]:
    model = build_tiny_llama(tmp_path / "m", alphabet=ALPHABET, hidden_size=32, num_heads=2, num_kv_heads=1)
    tok = load_tokenizer(model)
    engine = ScriptedEngine(tok, replies)
    ctx = RolloutContext(engine=engine, tokenizer=tok, config=make_config(), log=structlog.get_logger())  # type: ignore[arg-type]
    sample = Sample(group_index=0, index=0, prompt="12+34=", label="46")
    asyncio.run(generate(ctx, sample, {"max_new_tokens": 4, "temperature": 1.0}))
    return sample, engine


def test_a_tool_call_appends_the_tool_output_untrained_and_asks_again(tmp_path: Any) -> None:
    sample, engine = run_tool_use(tmp_path, ["?", "46"])
    assert sample.response == "?46;46"
    assert sample.loss_mask == [1, 0, 0, 0, 1, 1]  # "?" trained, "46;" written by the tool, "46" trained
    assert sample.weight_versions == [1, None, None, None, 2, 2]
    assert len(engine.calls) == 2
    assert engine.calls[0][1]["stop_token_ids"] == engine.tok.encode("?")  # turn 1 stops at the call
    assert engine.calls[1][0] == sample.tokens[:-2]  # turn 2 sees the prompt, the call and the result
    sample.validate()
    assert asyncio.run(reward(None, sample)) == {"reward": 0.8, "accuracy": 1.0, "tool_calls": 1.0}  # type: ignore[arg-type]


def test_a_direct_answer_is_one_turn_and_earns_full_reward(tmp_path: Any) -> None:
    sample, engine = run_tool_use(tmp_path, ["46"])
    assert sample.loss_mask == [1, 1] and len(engine.calls) == 1
    assert asyncio.run(reward(None, sample))["reward"] == 1.0  # type: ignore[arg-type]

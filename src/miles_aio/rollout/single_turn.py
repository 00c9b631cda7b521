"""The default rollout coroutine: one `/generate` call per sample."""

from __future__ import annotations

from typing import Any

from miles_aio.data.source import encode_prompt
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import Sample, Status

__all__ = ["generate", "prompt_token_ids"]


def prompt_token_ids(ctx: RolloutContext, sample: Sample) -> list[int]:
    """Tokenize the prompt once (kept in sample.tokens); chat prompts go through the chat template."""
    if sample.tokens:
        return sample.tokens
    if ctx.tokenizer is None:
        raise RuntimeError("the sample has no tokens and the rollout context has no tokenizer")
    ids = ctx.prompt_ids.get(sample.group_index, sample.prompt)  # a sibling sample encoded it
    if ids is None:
        ids = encode_prompt(ctx.tokenizer, sample.prompt)
        ctx.prompt_ids.put(sample.group_index, sample.prompt, ids)
    sample.tokens = ids
    return sample.tokens


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Generate one response; respects --rollout-max-context-len (TRUNCATED without a call if full)."""
    input_ids = prompt_token_ids(ctx, sample)
    params = sampling_params
    max_ctx = ctx.config.rollout.rollout_max_context_len
    if max_ctx is not None:
        budget = max_ctx - len(input_ids)
        if budget <= 0:
            sample.status = Status.TRUNCATED
            return sample
        params = dict(sampling_params)  # the caller's dict is left as it was
        params["max_new_tokens"] = min(int(params["max_new_tokens"]), budget)
    out = await ctx.engine.generate(
        input_ids=input_ids, sampling_params=params, routing_key=sample.group_index
    )
    sample.append(out)
    return sample

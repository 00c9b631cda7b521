"""`RolloutPool`: runs one prompt group — the user's generate, then reward, for every sample.

consumes: a PENDING prompt group (from the rollout worker)
produces: the finished group (samples in order; a generate fn returning a list adds samples)
waits for: the user's coroutines, which wait for limiter slots and engine responses
reports: `on_sample_done()` once per sample when its task ends, whatever the outcome (success,
         exception, cancellation), so the scheduler's slot accounting is conserved.

Failures become statuses, not silent drops. An engine that stays unavailable after the client's
retries (`EngineError`) makes the sample ABORTED (the buffer sends the group to the unused handler).
An exception from user code follows `--rollout-failure-policy`: `fail` (default) cancels the group's
other samples and propagates, failing the run loudly; `drop` and `retry` mark the sample FAILED with
its traceback logged and in `metadata["error"]`, and the buffer drops or recycles the group.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from miles_aio.errors import EngineError
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import Group, Sample, Status

__all__ = ["GenerateFn", "RewardFn", "RolloutPool", "sampling_params_from_config"]


class GenerateFn(Protocol):
    def __call__(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Awaitable[Sample | list[Sample]]: ...


RewardFn = Callable[[RolloutContext, Any], Awaitable[Any]]


def sampling_params_from_config(ctx: RolloutContext) -> dict[str, Any]:
    r = ctx.config.rollout
    params: dict[str, Any] = {
        "max_new_tokens": r.rollout_max_response_len,
        "temperature": r.rollout_temperature,
        "top_p": r.rollout_top_p,
        "top_k": r.rollout_top_k,
    }
    if r.rollout_stop_token_ids:
        params["stop_token_ids"] = list(r.rollout_stop_token_ids)
    return params


class RolloutPool:
    def __init__(
        self,
        *,
        ctx: RolloutContext,
        generate_fn: GenerateFn,
        reward_fn: RewardFn | None,
        group_rm: bool = False,
        sampling_params: dict[str, Any] | None = None,
    ) -> None:
        self.ctx = ctx
        self._generate = generate_fn
        self._reward = reward_fn
        self._group_rm = group_rm
        self._params = sampling_params if sampling_params is not None else sampling_params_from_config(ctx)

    async def run_group(self, prompt_group: Group, *, on_sample_done: Callable[[], None]) -> Group:
        results: list[list[Sample]] = [[] for _ in prompt_group]
        async with asyncio.TaskGroup() as tg:
            for i, sample in enumerate(prompt_group):
                tg.create_task(
                    self._run_sample(sample, results, i, on_sample_done), name=f"sample-{sample.index}"
                )
        group = [s for outs in results for s in outs]
        if self._group_rm and self._reward is not None:
            scored = [s for s in group if _scorable(s)]
            if scored:
                rewards = await self._reward(self.ctx, scored)
                if not isinstance(rewards, list) or len(rewards) != len(scored):
                    raise TypeError(f"a --group-rm reward must return a list of {len(scored)} rewards")
                for s, r in zip(scored, rewards, strict=True):
                    s.reward = r
        return group

    async def _run_sample(
        self, sample: Sample, results: list[list[Sample]], i: int, on_sample_done: Callable[[], None]
    ) -> None:
        try:
            out = await self._generate(self.ctx, sample, dict(self._params))
            outs = out if isinstance(out, list) else [out]
            if not self._group_rm and self._reward is not None:
                for s in outs:
                    if s.reward is None and _scorable(s):
                        s.reward = await self._reward(self.ctx, s)
            results[i] = outs
        except EngineError as e:
            sample.status = Status.ABORTED
            sample.metadata["error"] = f"{type(e).__name__}: {e}"
            self.ctx.log.warning("engine failed; sample aborted", sample=sample.index, error=str(e))
            results[i] = [sample]
        except Exception:
            if self.ctx.config.rollout.rollout_failure_policy == "fail":
                raise
            sample.status = Status.FAILED
            sample.metadata["error"] = traceback.format_exc()
            self.ctx.log.error("user code raised; sample failed", sample=sample.index, exc_info=True)
            results[i] = [sample]
        finally:
            on_sample_done()


def _scorable(s: Sample) -> bool:
    return s.status not in (Status.ABORTED, Status.FAILED, Status.PENDING)

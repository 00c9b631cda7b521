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
its traceback logged and in `metadata["error"]`, and the buffer drops or recycles the group. A
`RolloutFailed` (an agent that raised, or gave no model turn) follows the same policy, logged as one line.

User code that returns something unusable is treated exactly like user code that raised (an
`InvalidSampleError` under the same policy): a returned object that is not a `Sample`, a sample still
PENDING, response-aligned lists that disagree (`Sample.validate`), a reward the reward function left
None, a reward that is not a finite number (or, for dict rewards, lacks a finite `--reward-key` entry),
or, for training, a number of samples per prompt sample the batch arithmetic cannot take (a list
return must hold exactly one sample unless `--global-batch-size` and `--num-steps-per-rollout` are
unset and there is one data-parallel rank, where a step takes any sample count). A `--group-rm` reward
that raises or returns the wrong shape fails the whole group under the policy. Eval samples
(`ctx.evaluation`) get the structural checks only: eval scores dict rewards without `--reward-key`
and may return several samples per prompt.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from miles_aio.errors import EngineError
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import Group, Sample, Status, scalar_reward

__all__ = [
    "GenerateFn",
    "InvalidSampleError",
    "RewardFn",
    "RolloutFailed",
    "RolloutPool",
    "sampling_params_from_config",
]


class InvalidSampleError(ValueError):
    """User code (generate, reward, --group-rm reward) returned something the trainer cannot use."""


class RolloutFailed(Exception):
    """A rollout failed for a reason its message says in one line (e.g. an agent raised: the cause is
    chained). Same policy as an exception from user code, but logged as that one line; the traceback goes
    to `metadata["error"]` only."""


class GenerateFn(Protocol):
    def __call__(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Awaitable[Sample | list[Sample]]: ...


RewardFn = Callable[[RolloutContext, Any], Awaitable[Any]]


def sampling_params_from_config(ctx: RolloutContext) -> dict[str, Any]:
    """SGLang sampling params as miles' `compute_request_payload` builds them: the response text keeps a
    matched stop string (`no_stop_trim`) and, unless --rollout-skip-special-tokens, special tokens, so a
    reward function ported from miles sees the same text."""
    r = ctx.config.rollout
    params: dict[str, Any] = {
        "max_new_tokens": r.rollout_max_response_len,
        "temperature": r.rollout_temperature,
        "top_p": r.rollout_top_p,
        "top_k": r.rollout_top_k,
        "skip_special_tokens": r.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if r.rollout_stop_token_ids:
        params["stop_token_ids"] = list(r.rollout_stop_token_ids)
    if r.rollout_stop:
        params["stop"] = list(r.rollout_stop)
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
        # per sample, as it finishes: score it (else the --group-rm reward scores the group), check it
        self._score_each = reward_fn is not None and not group_rm
        self._check_each = not (group_rm and reward_fn is not None)  # else checked once the group is scored

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
                try:
                    rewards = await self._reward(self.ctx, scored)
                    if not isinstance(rewards, list) or len(rewards) != len(scored):
                        raise InvalidSampleError(
                            f"a --group-rm reward must return a list of {len(scored)} rewards, "
                            f"got {_describe(rewards)}"
                        )
                    for s, r in zip(scored, rewards, strict=True):
                        s.reward = r
                    for s in scored:
                        self._check_reward(s)
                except Exception as e:
                    if self.ctx.config.rollout.rollout_failure_policy == "fail":
                        raise
                    error = traceback.format_exc()
                    for s in scored:
                        s.status = Status.FAILED
                        s.metadata["error"] = error
                    self.ctx.log.error(
                        "group reward (--group-rm) failed; group failed",
                        group=prompt_group[0].group_index if prompt_group else None,
                        error=f"{type(e).__name__}: {e}",
                        exc_info=True,
                    )
        return group

    async def _run_sample(
        self, sample: Sample, results: list[list[Sample]], i: int, on_sample_done: Callable[[], None]
    ) -> None:
        try:
            out = await self._generate(self.ctx, sample, dict(self._params))
            outs = self._check_generated(out)
            if self._score_each:
                assert self._reward is not None
                for s in outs:
                    if s.reward is None and _scorable(s):
                        s.reward = await self._reward(self.ctx, s)
            if self._check_each:
                for s in outs:
                    self._check_reward(s)
            results[i] = outs
        except EngineError as e:
            sample.status = Status.ABORTED
            sample.metadata["error"] = f"{type(e).__name__}: {e}"
            self.ctx.log.warning("engine failed; sample aborted", sample=sample.index, error=str(e))
            results[i] = [sample]
        except InvalidSampleError as e:
            if self.ctx.config.rollout.rollout_failure_policy == "fail":
                raise
            sample.status = Status.FAILED
            sample.metadata["error"] = f"{type(e).__name__}: {e}"
            self.ctx.log.error(
                "user code returned an invalid sample; sample failed", sample=sample.index, error=str(e)
            )
            results[i] = [sample]
        except RolloutFailed as e:
            if self.ctx.config.rollout.rollout_failure_policy == "fail":
                raise
            sample.status = Status.FAILED
            sample.metadata["error"] = traceback.format_exc()
            self.ctx.log.error("rollout failed; sample failed", sample=sample.index, error=str(e))
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

    def _check_generated(self, out: object) -> list[Sample]:
        """What generate returned, as a list of structurally valid, finished samples (else raise
        InvalidSampleError naming what is wrong)."""
        outs: list[object] = list(out) if isinstance(out, list) else [out]
        if not self.ctx.evaluation and len(outs) != 1 and not _variable_sample_count(self.ctx):
            raise InvalidSampleError(
                f"generate returned {len(outs)} samples for one prompt sample; several (or none) per "
                "prompt sample need a step that takes any sample count (leave --global-batch-size and "
                "--num-steps-per-rollout unset, one data-parallel rank)"
            )
        if not outs:
            raise InvalidSampleError("generate returned an empty list")
        samples: list[Sample] = []
        for s in outs:
            if not isinstance(s, Sample):
                raise InvalidSampleError(f"generate returned {_describe(s)}, not a Sample")
            if s.status not in _FINISHED:
                raise InvalidSampleError(
                    f"generate returned sample {s.index} with status {str(s.status)!r}: it must end "
                    "completed, truncated, aborted or failed (did it append an engine output?)"
                )
            if s.status != Status.ABORTED:  # aborted samples are recycled or dropped, never trained
                try:
                    s.validate()
                except ValueError as e:
                    raise InvalidSampleError(f"generate returned an inconsistent sample: {e}") from e
            samples.append(s)
        return samples

    def _check_reward(self, s: Sample) -> None:
        """A scorable sample's reward must be usable by the trainer (`types.scalar_reward`)."""
        if not _scorable(s) or self.ctx.evaluation:
            return
        reward: object = s.reward
        if reward is None:
            if self._reward is not None:
                raise InvalidSampleError(f"the reward function returned None for sample {s.index}")
            raise InvalidSampleError(  # the trainer needs one: say so now, not at the training step
                f"sample {s.index} has no reward: there is no --custom-rm-path, so generate must set "
                "sample.reward"
            )
        try:
            scalar_reward(reward, self.ctx.config.train.reward_key)  # the trainer's own reading of it
        except ValueError as e:
            raise InvalidSampleError(f"sample {s.index}: {e}") from None


# tuples, not sets: `in` finds an enum member by identity, where a set would call Enum's Python __hash__
_FINISHED = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED)
_UNSCORABLE = (Status.ABORTED, Status.FAILED, Status.PENDING)


def _scorable(s: Sample) -> bool:
    return s.status not in _UNSCORABLE


def _variable_sample_count(ctx: RolloutContext) -> bool:
    """Whether a training step takes any number of samples (`check_batch_arithmetic` cannot fail):
    the global batch is the whole rollout and there is one data-parallel rank."""
    t = ctx.config.train
    return t.global_batch_size is None and t.num_steps_per_rollout is None and t.dp_size == 1


def _describe(x: object) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:80] + '...' if len(text) > 80 else text}"

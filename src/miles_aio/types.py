"""Data types shared by every component: `Sample`, its `Status`, groups and engine outputs.

A *prompt group* is the `n_samples_per_prompt` samples of one prompt; the scheduler admits, and the
buffer stores, whole groups. Every response token carries the policy version that produced it
(`Sample.weight_versions`), so staleness is exact even when a weight push lands mid-request.

Versions are integers that only go up. The first weight push makes version 1; before it, versions are
unknown (None), and so is staleness: unknown is not the same as fresh.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

__all__ = [
    "BufferItem",
    "FinishReason",
    "GenerateOutput",
    "Group",
    "RunSummary",
    "Sample",
    "Status",
    "group_oldest_version",
    "group_staleness",
    "scalar_reward",
]

FinishReason = Literal["stop", "length", "abort"]


class Status(enum.StrEnum):
    """Lifecycle of one sample. Only PENDING samples (or ABORTED ones being continued) are generated."""

    PENDING = "pending"
    COMPLETED = "completed"  # the engine stopped on EOS or a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens / the context limit
    # the engine aborted the request (pause in abort mode, shutdown), or the call failed at the engine
    # (unreachable after the router's retries, an error status, an unusable answer): the unused handler
    ABORTED = "aborted"
    FAILED = "failed"  # user code raised (reward, generate, dynamic filter): --rollout-failure-policy


_FINISH_TO_STATUS: dict[str, Status] = {
    "stop": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateOutput:
    """What one `/generate` call produced, already validated and decoded by the engine client.

    Lists are per output token and all have the same length.
    """

    text: str
    output_ids: list[int]
    output_log_probs: list[float]
    weight_versions: list[int | None]
    """The policy version that produced each token (from `meta_info.weight_versions` spans, or the
    single `meta_info.weight_version` when weights did not change during the request)."""
    finish_reason: FinishReason
    prompt_tokens: int = 0
    """The request's prompt length (of a partial-rollout generation: the first piece's)."""
    cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache (`meta_info.cached_tokens`; 0 when the
    engine does not say), summed over the pieces of a partial-rollout generation."""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_log_probs) != n or len(self.weight_versions) != n:
            raise ValueError(
                f"GenerateOutput lists disagree: {n} output_ids, {len(self.output_log_probs)} log probs, "
                f"{len(self.weight_versions)} weight versions"
            )


@dataclass(kw_only=True, slots=True)
class Sample:
    """One trajectory: a prompt and the response generated for it.

    Response-aligned lists (`loss_mask`, `rollout_log_probs`, `weight_versions`) have exactly
    `response_length` entries. Tokens that the policy did not generate (tool output, chat glue) have
    `loss_mask` 0, log prob 0.0 and version None.
    """

    group_index: int
    """Stable id of the prompt group: the same across recycling and resume (see `DataSource`)."""
    index: int
    """Position of this sample in the run's sample stream: group_index * n_samples_per_prompt + k."""
    prompt: str | list[dict[str, Any]]
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    """Prompt ids followed by response ids."""
    response: str = ""
    response_length: int = 0
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int | None] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache (SGLang's `meta_info.cached_tokens`), summed
    over every engine call `append`ed: each turn of a multi-turn rollout and each partial-rollout
    continuation (miles: `sample.prefix_cache_info.cached_tokens`)."""

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest policy version among the generated tokens, or None if none is known."""
        versions = self.weight_versions
        if not versions:
            return None
        first = versions[0]
        if versions.count(first) == len(versions):  # one policy made it all (most samples): one C scan
            return first
        if None not in versions:
            return min(cast("list[int]", versions))
        known = [v for v in versions if v is not None]
        return min(known) if known else None

    def append(self, out: GenerateOutput) -> None:
        """Append one engine call's tokens (trainable: loss_mask 1) and take its finish status."""
        n = len(out.output_ids)
        self.tokens.extend(out.output_ids)
        self.response += out.text
        self.response_length += n
        self.loss_mask.extend([1] * n)
        self.rollout_log_probs.extend(out.output_log_probs)
        self.weight_versions.extend(out.weight_versions)
        self.cached_tokens += out.cached_tokens
        self.status = _FINISH_TO_STATUS[out.finish_reason]

    def append_context(self, token_ids: Sequence[int], text: str = "") -> None:
        """Append tokens the policy did not generate (e.g. tool output): they are not trained on."""
        n = len(token_ids)
        self.tokens.extend(token_ids)
        self.response += text
        self.response_length += n
        self.loss_mask.extend([0] * n)
        self.rollout_log_probs.extend([0.0] * n)
        self.weight_versions.extend([None] * n)

    def reset_for_retry(self) -> None:
        """Forget everything generated, keep identity/prompt/label/metadata: ready to be re-admitted."""
        self.tokens = self.tokens[: self.prompt_length]
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.loss_mask = []
        self.rollout_log_probs = []
        self.weight_versions = []
        self.cached_tokens = 0
        self.status = Status.PENDING

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (checkpoints, logs)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        fields = dict(d)
        fields["status"] = Status(fields.get("status", Status.PENDING))
        return cls(**fields)

    def validate(self) -> None:
        """Raise ValueError if the response-aligned lists disagree with `response_length`."""
        n = self.response_length
        if (  # the common case, without building the report below (once per sample on the hot path)
            len(self.loss_mask) == n
            and len(self.rollout_log_probs) == n
            and len(self.weight_versions) == n
            and n <= len(self.tokens)
        ):
            return
        lengths = {
            "loss_mask": len(self.loss_mask),
            "rollout_log_probs": len(self.rollout_log_probs),
            "weight_versions": len(self.weight_versions),
        }
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad or n > len(self.tokens):
            raise ValueError(
                f"sample {self.index} (group {self.group_index}): response_length={n}, "
                f"tokens={len(self.tokens)}, mismatched={bad}"
            )


Group = list[Sample]
"""The finished samples of one prompt group (a generate function may return several per prompt)."""


class BufferItem:
    """What the rollout worker hands the buffer for each finished prompt group: the finished samples
    and, for recycling (`retry`), pristine copies of the prompt group as admitted.

    The pristine copies are built on first read: only a recycle or a checkpoint reads them, and building
    them for every group was a tenth of the controller's own cost per sample (`benchmarks.controller`).
    Give them (`prompt_group=`), or say how to make them from the group id (`make_prompt_group=`, with
    `group_index=`; the rollout worker passes `DataSource.make_group`, deterministic from the id)."""

    __slots__ = ("_make_prompt_group", "_prompt_group", "group", "group_index")

    def __init__(
        self,
        group: Group,
        prompt_group: Group | None = None,
        *,
        group_index: int | None = None,
        make_prompt_group: Callable[[int], Group] | None = None,
    ) -> None:
        if prompt_group is not None:
            if not prompt_group:
                raise ValueError("a BufferItem's prompt_group is empty")
            group_index = prompt_group[0].group_index
        elif group_index is None or make_prompt_group is None:
            raise ValueError("a BufferItem needs prompt_group, or group_index and make_prompt_group")
        self.group = group
        """The finished samples, as generated."""
        self.group_index: int = group_index
        self._prompt_group = prompt_group
        self._make_prompt_group = make_prompt_group

    @property
    def prompt_group(self) -> Group:
        """Pristine copies of the prompt group as admitted (built on the first read, then kept)."""
        if self._prompt_group is None:
            assert self._make_prompt_group is not None  # the constructor takes one or the other
            self._prompt_group = self._make_prompt_group(self.group_index)
        return self._prompt_group

    def __repr__(self) -> str:
        return f"BufferItem(group_index={self.group_index}, samples={len(self.group)})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": [s.to_dict() for s in self.group],
            "prompt_group": [s.to_dict() for s in self.prompt_group],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferItem:
        return cls(
            group=[Sample.from_dict(s) for s in d["group"]],
            prompt_group=[Sample.from_dict(s) for s in d["prompt_group"]],
        )


def group_oldest_version(group: Sequence[Sample]) -> int | None:
    """Oldest policy version among all tokens of a group; None when no token has a known version."""
    known = [v for s in group if (v := s.oldest_weight_version) is not None]
    return min(known) if known else None


def group_staleness(group: Sequence[Sample], current_version: int | None) -> int | None:
    """current version − the group's oldest token version; None (unknown) if either is unknown."""
    oldest = group_oldest_version(group)
    if current_version is None or oldest is None:
        return None
    return current_version - oldest


@dataclass(slots=True)
class RunSummary:
    """What `Controller.run()` returns: steps done, the final policy version, timings, the last step's
    metrics and the ledger's fate counts."""

    steps: int = 0
    version: int | None = None
    wall_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    last_metrics: dict[str, float] = field(default_factory=dict)
    ledger_counts: dict[str, int] = field(default_factory=dict)


def scalar_reward(reward: object, reward_key: str | None) -> float:
    """A sample's reward as the float the trainer uses: the value itself, or `reward[reward_key]` for a
    dict reward (--reward-key). Raises ValueError saying what is wrong: no reward, a dict without the
    key, a value that is not a finite number. (The rollout checks rewards with it as they arrive.)"""
    if (type(reward) is float or type(reward) is int) and math.isfinite(reward):  # the common case (bool:
        return float(reward)  # below)
    if reward is None:
        raise ValueError("sample has no reward (did the reward function run?)")
    what = "reward"
    if isinstance(reward, Mapping):
        keys = sorted(map(str, reward))
        if reward_key is None:
            raise ValueError(f"dict reward with keys {keys} needs --reward-key")
        if reward_key not in reward:
            raise ValueError(f"dict reward has no --reward-key {reward_key!r} (keys {keys})")
        reward, what = reward[reward_key], f"reward[{reward_key!r}]"
    try:
        value = float(reward)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        text = repr(reward)
        shown = text[:80] + "..." if len(text) > 80 else text
        raise ValueError(f"{what} is {type(reward).__name__} {shown}, not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}, not a finite number")
    return value

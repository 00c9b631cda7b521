"""`Session`: one rollout's conversation with the model, and the training sample it becomes.

A session is scoped to one rollout (one `Sample`): it is registered when the agentic generate starts the
agent and sealed when the agent returns, raises or is cancelled; a call after that is refused. Its turns
are the engine calls that answered the agent (see `tito`); a rolled-back turn is dropped, so the turns
always form one linear trajectory. Mutations happen under `lock`, one request at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_aio.rollout.agent.tito import Trajectory, TurnTokens, assemble, check_assembly, truncate
from miles_aio.types import FinishReason, Sample, Status

if TYPE_CHECKING:
    from miles_aio.rollout.context import RolloutContext, Tokenizer

__all__ = ["Session", "Turn", "trajectory_sample"]

_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass(frozen=True, slots=True)
class Turn:
    """One answered request: what the agent sent, what it got back, and the engine's tokens."""

    messages: Sequence[Mapping[str, Any]]
    reply: Mapping[str, Any]
    tools: Sequence[Mapping[str, Any]] | None
    tokens: TurnTokens
    finish_reason: FinishReason


@dataclass(eq=False, slots=True)
class Session:
    id: str
    base_url: str
    ctx: RolloutContext
    sampling_params: Mapping[str, Any]
    """The rollout's SGLang sampling params: every request's defaults."""
    turns: list[Turn] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    calls: int = 0
    """Requests received (answered or refused)."""
    rollbacks: int = 0
    out_of_budget: bool = False
    """A request found no room left under --max-seq-len / --rollout-max-context-len."""
    engine_error: str | None = None
    """The last engine failure, until a later turn succeeds."""
    call_ids: int = 0


def trajectory_sample(
    sample: Sample,
    turns: Sequence[Turn],
    *,
    tokenizer: Tokenizer,
    max_seq_len: int | None,
    out_of_budget: bool,
    skip_special_tokens: bool,
) -> Sample:
    """`sample` filled with the session's trajectory (checked token for token against the engine's), cut to
    `max_seq_len` tokens; status from the last turn (TRUNCATED if cut or out of budget). ValueError if
    the first prompt alone is longer than `max_seq_len`."""
    tokens = [t.tokens for t in turns]
    full = assemble(tokens)
    check_assembly(full, tokens)
    traj: Trajectory | None = full if max_seq_len is None else truncate(full, max_seq_len)
    if traj is None:
        raise ValueError(f"the first prompt alone is longer than --max-seq-len {max_seq_len}")
    cut = len(traj.tokens) < len(full.tokens)
    sample.tokens = traj.tokens
    sample.response_length = traj.response_length
    sample.loss_mask = traj.loss_mask
    sample.rollout_log_probs = traj.log_probs
    sample.weight_versions = traj.versions
    sample.response = tokenizer.decode(
        traj.tokens[traj.prompt_length :], skip_special_tokens=skip_special_tokens
    )
    status = _STATUS[turns[-1].finish_reason]
    if status != Status.ABORTED and (cut or out_of_budget):
        status = Status.TRUNCATED
    sample.status = status
    model_tokens = sum(traj.loss_mask)
    sample.metadata["session"] = {
        "turns": len(turns),
        "model_tokens": model_tokens,
        "context_tokens": traj.response_length - model_tokens,
        "truncated_by_max_seq_len": cut,
    }
    return sample

"""Token in, token out: the pure decisions of a linear agent session (no I/O, no event loop).

A session is a list of turns; each turn is what one engine call consumed (`prompt_ids`) and produced
(`output_ids`, with log-probs and per-token versions). The agent resends the whole conversation every
time; three functions turn that into the next engine input and, at the end, into one training sample:

`plan_turn(stored, request, ...)`  how much of the resent history is the session's: the matched prefix
    of messages (by the `--session-message-matcher`) is cut back to the last reply inside it. A request
    that extends the whole history keeps every turn; one that diverges after the last-but-one reply rolls
    the last turn back (an agent retrying a step, as miles' linear sessions allow: at most
    `max_rollback` turns; retrying the first step starts afresh); anything else (a request whose first
    prompt is not the session's is another conversation), or a change of `tools` (the template renders
    them in the prefix), is `HistoryDiverged`.
`next_prompt(kept, request, ...)`  the next engine input: the kept turn's own tokens (prompt + output:
    the model's tokens are never re-tokenized) plus the tokens of what was appended. The template renders
    the kept history (no generation prompt) and the whole request (with it); the second must extend the
    first, and only the difference is tokenized. A template that re-renders the past differently (it
    would change tokens the model already saw) is `HistoryDiverged`.
`assemble(turns)` / `check_assembly(traj, turns)`  the trajectory: the first prompt, then per turn the
    appended context (tool results, user messages, template glue: loss mask 0, log-prob 0.0, version
    None) and the turn's output (loss mask 1, the engine's log-probs and versions). The check, written
    independently, proves the assembled tokens are the engine's, turn by turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from miles_aio.rollout.agent.matchers import MessageMatcher

__all__ = [
    "HistoryDiverged",
    "StoredTurn",
    "TokenMismatch",
    "Trajectory",
    "TurnPlan",
    "TurnTokens",
    "assemble",
    "check_assembly",
    "matched_prefix",
    "next_prompt",
    "plan_turn",
    "truncate",
]

Message = Mapping[str, Any]


class HistoryDiverged(ValueError):
    """The resent conversation is not the session's (nor an allowed rollback of it)."""


class TokenMismatch(AssertionError):
    """Assembled tokens that are not the engine's: a bug, never a user error."""


@dataclass(frozen=True, slots=True)
class TurnTokens:
    """What one engine call consumed and produced (`output_*` lists have one entry per output token)."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    log_probs: Sequence[float]
    versions: Sequence[int | None]


class StoredTurn(Protocol):
    """What `plan_turn` reads of a stored turn."""

    @property
    def messages(self) -> Sequence[Message]:
        """The request's messages, as the agent sent them."""

    @property
    def reply(self) -> Message:
        """The assistant message the session answered with."""

    @property
    def tools(self) -> Sequence[Message] | None: ...


@dataclass(frozen=True, slots=True)
class TurnPlan:
    keep: int
    """Stored turns kept (0: a fresh conversation, rendered whole); later ones are rolled back."""
    prefix_len: int
    """Messages of the request that the kept turns cover (the last kept turn's messages + its reply)."""


def matched_prefix(stored: Sequence[Message], request: Sequence[Message], matcher: MessageMatcher) -> int:
    """How many leading messages of `request` match `stored`, position by position."""
    n = 0
    for a, b in zip(stored, request, strict=False):
        if not matcher(a, b):
            break
        n += 1
    return n


def plan_turn(
    stored: Sequence[StoredTurn],
    request: Sequence[Message],
    *,
    matcher: MessageMatcher,
    tools: Sequence[Message] | None,
    max_rollback: int = 1,
) -> TurnPlan:
    """Which stored turns the request continues (see the module docstring); HistoryDiverged if none."""
    if not request:
        raise HistoryDiverged("the request has no messages")
    if not stored:
        return TurnPlan(keep=0, prefix_len=0)
    last = stored[-1]
    history = [*last.messages, last.reply]
    m = matched_prefix(history, request, matcher)
    if m == len(history):
        keep = len(stored)
    else:
        keep = max((i + 1 for i, t in enumerate(stored) if len(t.messages) + 1 <= m), default=0)
        where = (
            f"message {m} of the resent history ({_role(request, m)}) differs from the session's "
            f"({_role(history, m)})"
        )
        if m < len(stored[0].messages):
            raise HistoryDiverged(
                f"{where}, before the session's first reply: this is another conversation (a session "
                "holds one; start a new rollout for another)"
            )
        if len(stored) - keep > max_rollback:
            raise HistoryDiverged(
                f"{where}: continuing from there would roll back {len(stored) - keep} replies, at most "
                f"{max_rollback} can be (an agent may retry its last step only)"
            )
    if keep == 0:  # the first step retried: rendered afresh
        return TurnPlan(keep=0, prefix_len=0)
    if _norm_tools(tools) != _norm_tools(stored[keep - 1].tools):
        raise HistoryDiverged(
            "tools changed on a continued conversation: the chat template renders them before the "
            "session's tokens, which cannot change"
        )
    return TurnPlan(keep=keep, prefix_len=len(stored[keep - 1].messages) + 1)


def _role(messages: Sequence[Message], i: int) -> str:
    return f"role {messages[i].get('role')!r}" if i < len(messages) else "absent"


def _norm_tools(tools: Sequence[Message] | None) -> list[Message]:
    return list(tools or [])


def next_prompt(
    kept: TurnTokens | None,
    request: Sequence[Message],
    prefix_len: int,
    *,
    render: Callable[[Sequence[Message], bool], str],
    encode: Callable[[str], list[int]],
) -> list[int]:
    """The engine input for `request` (see the module docstring). `render(messages, add_generation_prompt)`
    is the chat template with the request's tools; `encode` tokenizes without adding special tokens."""
    if kept is None:
        return encode(render(request, True))
    before = render(request[:prefix_len], False)
    after = render(request, True)
    if not after.startswith(before):
        cut = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(after))
        raise HistoryDiverged(
            f"the chat template renders the conversation so far differently once messages are appended "
            f"(the texts part at character {cut}): the session's tokens cannot be extended"
        )
    return [*kept.prompt_ids, *kept.output_ids, *encode(after[len(before) :])]


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One sample's tokens: `tokens[:prompt_length]` is the first prompt; the response-aligned lists cover
    the rest."""

    tokens: list[int]
    prompt_length: int
    loss_mask: list[int]
    log_probs: list[float]
    versions: list[int | None]

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length


def assemble(turns: Sequence[TurnTokens]) -> Trajectory:
    """The trajectory of a linear session; TokenMismatch if a turn's prompt does not extend the tokens
    before it (the session only builds prompts that do)."""
    if not turns:
        raise ValueError("a trajectory needs at least one turn")
    tokens = list(turns[0].prompt_ids)
    prompt_length = len(tokens)
    mask: list[int] = []
    log_probs: list[float] = []
    versions: list[int | None] = []
    for i, t in enumerate(turns):
        prompt = list(t.prompt_ids)
        if prompt[: len(tokens)] != tokens:
            at = next(
                (j for j, (a, b) in enumerate(zip(tokens, prompt, strict=False)) if a != b), len(prompt)
            )
            raise TokenMismatch(f"turn {i}'s prompt does not extend the trajectory (they part at token {at})")
        if not len(t.output_ids) == len(t.log_probs) == len(t.versions):
            raise TokenMismatch(f"turn {i}'s output lists disagree in length")
        gap = prompt[len(tokens) :]
        tokens += gap
        mask += [0] * len(gap)
        log_probs += [0.0] * len(gap)
        versions += [None] * len(gap)
        tokens += t.output_ids
        mask += [1] * len(t.output_ids)
        log_probs += t.log_probs
        versions += t.versions
    return Trajectory(tokens, prompt_length, mask, log_probs, versions)


def check_assembly(traj: Trajectory, turns: Sequence[TurnTokens]) -> None:
    """TokenMismatch unless `traj` is exactly the engine's tokens: every turn's prompt is a prefix of it,
    its output follows at loss mask 1 with its log-probs and versions, every other response token is at
    mask 0 (log-prob 0.0, version None), and the whole is the last turn's prompt + output."""
    n, p = len(traj.tokens), traj.prompt_length
    if not len(traj.loss_mask) == len(traj.log_probs) == len(traj.versions) == n - p:
        raise TokenMismatch("response-aligned lists disagree with the response length")
    if not turns or traj.tokens[:p] != list(turns[0].prompt_ids):
        raise TokenMismatch("the trajectory does not start with the first turn's prompt")
    trained = [False] * n
    for i, t in enumerate(turns):
        start, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.output_ids)
        if traj.tokens[:start] != list(t.prompt_ids) or traj.tokens[start:end] != list(t.output_ids):
            raise TokenMismatch(f"turn {i}: the trajectory is not its prompt followed by its output")
        if traj.log_probs[start - p : end - p] != list(t.log_probs) or traj.versions[
            start - p : end - p
        ] != list(t.versions):
            raise TokenMismatch(f"turn {i}: log-probs or versions are not the engine's")
        for j in range(start, end):
            trained[j] = True
    last = turns[-1]
    if traj.tokens != [*last.prompt_ids, *last.output_ids]:
        raise TokenMismatch("the trajectory is not the last turn's prompt + output")
    for j in range(p, n):
        k = j - p
        if traj.loss_mask[k] != int(trained[j]):
            raise TokenMismatch(f"token {j}: loss mask {traj.loss_mask[k]}, expected {int(trained[j])}")
        if not trained[j] and (traj.log_probs[k] != 0.0 or traj.versions[k] is not None):
            raise TokenMismatch(f"token {j}: context token with a log-prob or a version")


def truncate(traj: Trajectory, max_len: int) -> Trajectory | None:
    """The first `max_len` tokens (`--max-seq-len`); None when the prompt alone fills them."""
    if len(traj.tokens) <= max_len:
        return traj
    if max_len <= traj.prompt_length:
        return None
    k = max_len - traj.prompt_length
    return Trajectory(
        traj.tokens[:max_len], traj.prompt_length, traj.loss_mask[:k], traj.log_probs[:k], traj.versions[:k]
    )

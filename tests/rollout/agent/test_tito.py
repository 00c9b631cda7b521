"""The pure TITO decisions: assembly and its check, history planning, the next prompt (hypothesis)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio.rollout.agent.matchers import strict_message_matches
from miles_aio.rollout.agent.tito import (
    HistoryDiverged,
    TokenMismatch,
    TurnTokens,
    assemble,
    check_assembly,
    next_prompt,
    plan_turn,
    truncate,
)

pytestmark = pytest.mark.pure

ids = st.lists(st.integers(0, 50), max_size=6)


@st.composite
def linear_turns(draw: st.DrawFn) -> list[TurnTokens]:
    """Turns as a session builds them: each prompt = the previous prompt + output + appended context."""
    prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
    turns = []
    for _ in range(draw(st.integers(1, 5))):
        out = draw(ids)
        versions = draw(
            st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=len(out), max_size=len(out))
        )
        lps = [-(t + 1) / 10 for t in out]
        turns.append(TurnTokens(list(prompt), out, lps, versions))
        prompt = [*prompt, *out, *draw(ids)]
    return turns


@settings(max_examples=300, deadline=None)
@given(turns=linear_turns())
def test_assembly_is_the_engines_tokens_turn_by_turn(turns: list[TurnTokens]) -> None:
    traj = assemble(turns)
    check_assembly(traj, turns)  # the independent check agrees
    assert traj.tokens == [*turns[-1].prompt_ids, *turns[-1].output_ids]
    assert traj.prompt_length == len(turns[0].prompt_ids)
    assert sum(traj.loss_mask) == sum(len(t.output_ids) for t in turns)  # exactly the model's tokens
    assert [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m] == [
        v for t in turns for v in t.versions
    ]


@settings(max_examples=300, deadline=None)
@given(turns=linear_turns(), data=st.data())
def test_a_changed_token_is_caught(turns: list[TurnTokens], data: st.DataObject) -> None:
    traj = assemble(turns)
    pos = data.draw(st.integers(0, len(traj.tokens) - 1))
    tokens = list(traj.tokens)
    tokens[pos] += 1
    with pytest.raises(TokenMismatch):
        check_assembly(replace(traj, tokens=tokens), turns)
    if traj.response_length:  # a context token marked trained, or a trained one marked context
        k = data.draw(st.integers(0, traj.response_length - 1))
        mask = list(traj.loss_mask)
        mask[k] = 1 - mask[k]
        with pytest.raises(TokenMismatch):
            check_assembly(replace(traj, loss_mask=mask), turns)


@settings(max_examples=200, deadline=None)
@given(turns=linear_turns(), data=st.data())
def test_a_prompt_that_does_not_extend_the_trajectory_is_refused(
    turns: list[TurnTokens], data: st.DataObject
) -> None:
    if len(turns) < 2:
        return
    i = data.draw(st.integers(1, len(turns) - 1))
    p = list(turns[i].prompt_ids)
    before = len(turns[i - 1].prompt_ids) + len(turns[i - 1].output_ids)  # what the trajectory already holds
    j = data.draw(st.integers(0, before - 1))
    p[j] += 100  # re-tokenized: an earlier token changed
    bad = [*turns[:i], replace(turns[i], prompt_ids=p), *turns[i + 1 :]]
    with pytest.raises(TokenMismatch):
        assemble(bad)


@given(turns=linear_turns(), max_len=st.integers(1, 40))
def test_truncation_keeps_a_prefix_and_its_alignment(turns: list[TurnTokens], max_len: int) -> None:
    traj = assemble(turns)
    cut = truncate(traj, max_len)
    if max_len <= traj.prompt_length and len(traj.tokens) > max_len:
        assert cut is None
        return
    assert cut is not None
    assert cut.tokens == traj.tokens[: len(cut.tokens)]
    assert len(cut.tokens) == min(max_len, len(traj.tokens))
    assert cut.loss_mask == traj.loss_mask[: cut.response_length]
    assert cut.versions == traj.versions[: cut.response_length]


# ---- history planning --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    messages: Sequence[Mapping[str, Any]]
    reply: Mapping[str, Any]
    tools: Sequence[Mapping[str, Any]] | None = None


def conversation(n_turns: int) -> tuple[list[Stored], list[dict[str, Any]]]:
    """A session of n turns (user, reply, tool, reply, ...) and the full history the agent holds."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
    stored = []
    for k in range(n_turns):
        reply = {"role": "assistant", "content": f"a{k}"}
        stored.append(Stored(messages=list(history), reply=reply))
        history += [reply, {"role": "tool", "content": f"t{k}"}]
    return stored, history


@given(n=st.integers(1, 6), extra=st.integers(0, 3))
def test_an_extension_keeps_every_turn(n: int, extra: int) -> None:
    stored, history = conversation(n)
    request = history[: 2 * n] + [{"role": "user", "content": str(i)} for i in range(extra)]
    plan = plan_turn(stored, request, matcher=strict_message_matches, tools=None)
    assert (plan.keep, plan.prefix_len) == (n, 2 * n)


@given(n=st.integers(2, 6))
def test_a_retry_of_the_last_step_rolls_back_one_turn(n: int) -> None:
    stored, history = conversation(n)
    retry = [*history[: 2 * n - 2], {"role": "tool", "content": "a different result"}]
    plan = plan_turn(stored, retry, matcher=strict_message_matches, tools=None)
    assert (plan.keep, plan.prefix_len) == (n - 1, 2 * n - 2)
    # the same request as the last one (the client retried it): that turn is redone
    plan = plan_turn(stored, list(stored[-1].messages), matcher=strict_message_matches, tools=None)
    assert plan.keep == n - 1


@given(n=st.integers(3, 6), back=st.integers(2, 5))
def test_rolling_back_further_is_refused(n: int, back: int) -> None:
    stored, history = conversation(n)
    back = min(back, n - 1)
    edited = [*history[: 2 * (n - back)], {"role": "tool", "content": "rewritten"}]
    with pytest.raises(HistoryDiverged, match="roll back"):
        plan_turn(stored, edited, matcher=strict_message_matches, tools=None)


def test_another_conversation_or_other_tools_are_refused() -> None:
    stored, history = conversation(2)
    with pytest.raises(HistoryDiverged, match="another conversation"):
        plan_turn(
            stored,
            [{"role": "user", "content": "something else"}],
            matcher=strict_message_matches,
            tools=None,
        )
    with pytest.raises(HistoryDiverged, match="tools changed"):
        plan_turn(stored, history, matcher=strict_message_matches, tools=[{"type": "function"}])
    assert plan_turn([], history, matcher=strict_message_matches, tools=None).keep == 0


def test_next_prompt_reuses_the_stored_tokens_and_tokenizes_only_the_suffix() -> None:
    def render(msgs: Sequence[Mapping[str, Any]], gen: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}." for m in msgs) + ("<assistant>" if gen else "")

    encoded: list[str] = []

    def encode(text: str) -> list[int]:
        encoded.append(text)
        return [ord(c) for c in text]

    first = [{"role": "user", "content": "q"}]
    kept = TurnTokens(prompt_ids=[1, 2], output_ids=[7, 7, 7], log_probs=[0.0] * 3, versions=[1] * 3)
    request = [*first, {"role": "assistant", "content": "REWRITTEN"}, {"role": "tool", "content": "r"}]
    ids_ = next_prompt(kept, request, 2, render=render, encode=encode)
    assert ids_[:5] == [1, 2, 7, 7, 7]  # the model's own tokens, not "REWRITTEN"'s
    assert encoded == ["<tool>r.<assistant>"]
    assert next_prompt(None, first, 0, render=render, encode=encode) == encode("<user>q.<assistant>")

    def unstable(msgs: Sequence[Mapping[str, Any]], gen: bool) -> str:  # re-renders the past differently
        return render(msgs, gen).replace("<user>", f"<user n={len(msgs)}>")

    with pytest.raises(HistoryDiverged, match="renders the conversation so far differently"):
        next_prompt(kept, request, 2, render=unstable, encode=encode)

"""History matchers (miles' three, and import paths), tool-call parsers and the request format."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_aio.errors import PluginError
from miles_aio.rollout.agent.matchers import (
    loose_tool_call_message_matches,
    resolve_message_matcher,
    role_content_only_message_matches,
    strict_message_matches,
)
from miles_aio.rollout.agent.parsers import ParsedReply, ToolCall, parse_qwen25, resolve_tool_call_parser
from miles_aio.rollout.agent.protocol import RequestError, parse_chat_request

pytestmark = pytest.mark.pure


def call(args: str, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": args}, **extra}
    ]}  # fmt: skip


def test_the_three_matchers() -> None:
    stored = call('{"a": 1, "b": [1, 2]}')
    # what a client sends back: extra keys, `index`, content "" for null, arguments respelled
    echoed = {**call('{"a": 1, "b": [1, 2]}', index=0), "content": "", "refusal": None}
    respelled = call('{"b": [1, 2],  "a": 1.0}')
    assert strict_message_matches(stored, echoed)
    assert not strict_message_matches(stored, respelled)
    assert loose_tool_call_message_matches(stored, respelled)
    assert not loose_tool_call_message_matches(stored, call('{"a": 2, "b": [1, 2]}'))
    assert not loose_tool_call_message_matches(stored, call('{"a": true, "b": [1, 2]}'))  # true is not 1
    assert not loose_tool_call_message_matches(stored, call('{"a": 1, "a": 1, "b": [1, 2]}'))  # duplicate key
    assert role_content_only_message_matches(stored, call("whatever"))
    assert not role_content_only_message_matches(stored, {"role": "user", "content": None})
    for name, fn in [
        ("strict", strict_message_matches),
        ("loose_tool_call", loose_tool_call_message_matches),
        ("role_content_only", role_content_only_message_matches),
    ]:
        assert resolve_message_matcher(name) is fn
    assert (
        resolve_message_matcher("miles_aio.rollout.agent.matchers:strict_message_matches")
        is strict_message_matches
    )
    assert (
        resolve_message_matcher("miles_aio.rollout.agent.matchers.strict_message_matches")
        is strict_message_matches
    )
    with pytest.raises(PluginError, match="unknown message matcher"):
        resolve_message_matcher("exact")
    with pytest.raises(PluginError, match="plain function"):
        resolve_message_matcher("tests.rollout.agent.agents:echo_agent")  # a coroutine function


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@given(
    args=st.dictionaries(st.text(max_size=4), json_values, max_size=4), indent=st.sampled_from([None, 1, 3])
)
def test_loose_matches_any_respelling_of_the_same_object(args: dict[str, Any], indent: int | None) -> None:
    a = json.dumps(args)
    b = json.dumps(dict(reversed(list(args.items()))), indent=indent)
    assert loose_tool_call_message_matches(call(a), call(b))
    assert strict_message_matches(call(a), call(a))


def test_qwen25_parser() -> None:
    text = 'let me compute <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>'
    assert parse_qwen25(text) == ParsedReply("let me compute", (ToolCall("calc", '{"e": "1+2"}'),))
    two = (
        '<tool_call>\n{"name":"a","arguments":"{\\"x\\":1}"}\n</tool_call><tool_call>{"name":"b"}</tool_call>'
    )
    assert parse_qwen25(two) == ParsedReply(None, (ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")))
    broken = 'x <tool_call>{"name": "calc", "arguments": </tool_call>'
    assert parse_qwen25(broken) == ParsedReply(broken)  # left in the text, as SGLang leaves it
    assert parse_qwen25("") == ParsedReply(None)
    assert resolve_tool_call_parser("qwen25") is parse_qwen25
    with pytest.raises(PluginError, match="unknown tool-call parser"):
        resolve_tool_call_parser("hermes")


def test_requests_are_mapped_onto_sglang_params_or_refused() -> None:
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "seed": 3,
            "stop": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
            "unknown_field": 1,
        }
    )
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert (req.max_tokens, req.stop, req.stream, req.include_usage) == (7, ["x"], True, True)
    assert req.sampling == {"temperature": 0.5, "sampling_seed": 3}
    for body, what in [
        ({"messages": []}, "must not be empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n must be 1"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "wrong type"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    ]:
        with pytest.raises(RequestError, match=what):
            parse_chat_request(body)

"""Tool-call parsers (`--session-tool-call-parser`): the model's reply text → OpenAI `content`, `tool_calls`.

A parser is a pure function `parse(text) -> ParsedReply`. It only decides how the reply is *shown* to the
agent; the tokens the model produced are kept as they are (TITO), whatever the parser makes of them.

Built in:

    qwen25   SGLang's name for JSON in tags (Qwen 2.5, Hermes): every `<tool_call>{"name": ..., "arguments":
             {...}}</tool_call>` block is one call (whitespace around the JSON is allowed); the text outside
             the blocks is the content. A block whose body is not such an object stays in the content, as
             SGLang leaves a malformed call in the text.
    none     no parsing: the whole reply is the content.

Any other value is an import path (`pkg.mod:fn`) of a function with the same signature.

Streaming (`stream: true`) shows the content while the reply is generated, so it may only send text that
the parser's content will start with whatever the model writes next: `streamable_length(parser, text)`.
For `none` that is all of it; for `qwen25` the text before anything that could open a `<tool_call>`, less
its trailing whitespace (a call after it strips that), and nothing while the reply starts with
whitespace (stripped too if a call follows); for a parser given by import path nothing: its content is
sent whole once the reply is complete. Tool calls are always sent at the end, parsed from the whole reply.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from miles_aio.errors import PluginError
from miles_aio.import_paths import load_object

__all__ = [
    "BUILTIN_PARSERS",
    "ParsedReply",
    "ToolCall",
    "ToolCallParser",
    "parse_none",
    "parse_qwen25",
    "resolve_tool_call_parser",
    "streamable_length",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, as OpenAI's `function` object holds it: `arguments` is JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None
    """The text outside any tool call; None when there is none (OpenAI's `content: null`)."""
    tool_calls: tuple[ToolCall, ...] = ()


ToolCallParser: TypeAlias = Callable[[str], ParsedReply]

_QWEN25_BLOCK: Final = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_none(text: str) -> ParsedReply:
    """The reply as content, no tool calls."""
    return ParsedReply(content=text or None)


def parse_qwen25(text: str) -> ParsedReply:
    """`<tool_call>{"name": str, "arguments": object | str}</tool_call>` blocks → calls; the rest: content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _QWEN25_BLOCK.finditer(text):
        call = _json_call(m.group(1))
        if call is None:
            continue  # not a call: the block stays in the content
        kept.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return ParsedReply(content=content or None, tool_calls=tuple(calls))


def _json_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(name := obj.get("name"), str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
        args = parsed
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


BUILTIN_PARSERS: Final[dict[str, ToolCallParser]] = {"qwen25": parse_qwen25, "none": parse_none}

_QWEN25_OPEN: Final = "<tool_call>"


def _qwen25_streamable(text: str) -> int:
    if not text or text[0].isspace():
        return 0
    end = text.find(_QWEN25_OPEN)
    if end < 0:  # a tag may be starting at the end: hold back any suffix that begins one
        end = len(text)
        for k in range(min(len(_QWEN25_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(_QWEN25_OPEN[:k]):
                end -= k
                break
    return len(text[:end].rstrip())


_STREAMABLE: Final[dict[ToolCallParser, Callable[[str], int]]] = {
    parse_none: len,
    parse_qwen25: _qwen25_streamable,
}


def streamable_length(parser: ToolCallParser, text: str) -> int:
    """How many leading characters of `text`, a reply still being generated, `parser`'s content is sure
    to start with whatever follows (see the module docstring); 0 for a parser this module does not know."""
    streamable = _STREAMABLE.get(parser)
    return 0 if streamable is None else streamable(text)


def resolve_tool_call_parser(selector: str) -> ToolCallParser:
    """A built-in name, or the plain function at import path `selector`; PluginError if neither."""
    if selector in BUILTIN_PARSERS:
        return BUILTIN_PARSERS[selector]
    if ":" not in selector and "." not in selector:
        raise PluginError(
            f"unknown tool-call parser {selector!r}: use one of {', '.join(BUILTIN_PARSERS)} or an import "
            "path pkg.mod:fn"
        )
    fn = load_object(selector)
    if not callable(fn) or inspect.iscoroutinefunction(fn):
        raise PluginError(f"{selector!r} must be a plain function parse(text) -> ParsedReply")
    return fn  # type: ignore[no-any-return]

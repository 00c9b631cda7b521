"""History matchers: is a message the agent resent the same as the one the session stored?
(`--session-message-matcher`, miles' names and semantics.)

A matcher is a pure function `matches(stored, resent) -> bool` over two OpenAI message dicts. The session
uses it to find how much of a resent history is the conversation it already holds: that prefix keeps the
token ids it has (the model's own tokens are never re-tokenized); the rest is new.

    strict              the fields a chat template reads: role, content, reasoning_content, tool_calls
                        (within a tool call, the wire-only `index` is ignored); None, "" and [] are equal,
                        as they render the same. Other keys (`refusal`, `audio`, client extras) are ignored.
    loose_tool_call     strict, plus tool-call `arguments` that are the same JSON object spelled
                        differently (key order, spacing, 1 vs 1.0 as exact numbers) match.
    role_content_only   role and content only: tool calls and everything else are ignored, so the stored
                        prefix wins for whatever a template would read from them (high risk, as in miles).

Any other value is an import path (`pkg.mod:fn`, or miles' dotted `pkg.mod.fn`) of a plain function.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Final, TypeAlias

from miles_aio.errors import PluginError
from miles_aio.import_paths import load_object

__all__ = [
    "BUILTIN_MATCHERS",
    "MessageMatcher",
    "loose_tool_call_message_matches",
    "resolve_message_matcher",
    "role_content_only_message_matches",
    "strict_message_matches",
]

MessageMatcher: TypeAlias = Callable[[Mapping[str, Any], Mapping[str, Any]], bool]

_TEMPLATE_KEYS: Final = ("role", "content", "reasoning_content", "tool_calls")
_WIRE_ONLY_TOOL_CALL_KEYS: Final = frozenset({"index"})
_INVALID: Final = object()


def _norm(value: Any) -> Any:
    """None, "" and [] render the same in a template: one value for all three."""
    return None if value is None or value == "" or value == [] else value


def _project_calls(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    return [
        {k: v for k, v in c.items() if k not in _WIRE_ONLY_TOOL_CALL_KEYS} if isinstance(c, dict) else c
        for c in value
    ]


def strict_message_matches(stored: Mapping[str, Any], resent: Mapping[str, Any]) -> bool:
    """Equal on every field a chat template reads (see the module docstring)."""
    for key in _TEMPLATE_KEYS:
        a, b = _norm(stored.get(key)), _norm(resent.get(key))
        if key == "tool_calls":
            a, b = _project_calls(a), _project_calls(b)
        if a != b:
            return False
    return True


def role_content_only_message_matches(stored: Mapping[str, Any], resent: Mapping[str, Any]) -> bool:
    """Equal role and content (strict's empty-value rule); every other field is ignored."""
    return all(_norm(stored.get(k)) == _norm(resent.get(k)) for k in ("role", "content"))


def loose_tool_call_message_matches(stored: Mapping[str, Any], resent: Mapping[str, Any]) -> bool:
    """strict, or strict except tool-call arguments that are the same JSON object."""
    if strict_message_matches(stored, resent):
        return True
    for key in ("role", "content", "reasoning_content"):
        if _norm(stored.get(key)) != _norm(resent.get(key)):
            return False
    a, b = _norm(stored.get("tool_calls")), _norm(resent.get("tool_calls"))
    if not isinstance(a, list) or not isinstance(b, list):
        return bool(a == b)
    return len(a) == len(b) and all(_call_matches(x, y) for x, y in zip(a, b, strict=True))


def _call_matches(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return bool(a == b)
    a = {k: v for k, v in a.items() if k not in _WIRE_ONLY_TOOL_CALL_KEYS}
    b = {k: v for k, v in b.items() if k not in _WIRE_ONLY_TOOL_CALL_KEYS}
    if a.keys() != b.keys():
        return False
    for key in a:
        if key == "function" and isinstance(a[key], dict) and isinstance(b[key], dict):
            fa, fb = a[key], b[key]
            if fa.keys() != fb.keys():
                return False
            for k in fa:
                same = _arguments_match(fa[k], fb[k]) if k == "arguments" else fa[k] == fb[k]
                if not same:
                    return False
        elif a[key] != b[key]:
            return False
    return True


def _arguments_match(a: Any, b: Any) -> bool:
    na, nb = _json_object(a), _json_object(b)
    if na is _INVALID or nb is _INVALID:
        return bool(type(a) is type(b) and a == b)
    return bool(na == nb)


def _json_object(value: Any) -> Any:
    """A type-tagged, key-sorted form of a JSON object (text or dict); None/"" are the empty object."""
    if value is None or value == "":
        return ("object", ())
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(
                value,
                object_pairs_hook=_no_duplicate_keys,
                parse_int=Decimal,
                parse_float=_finite_decimal,
                parse_constant=_reject_constant,
            )
        except (ValueError, RecursionError):
            return _INVALID
    if not isinstance(parsed, dict):
        return _INVALID
    try:
        return _tag(parsed)
    except (ValueError, RecursionError):
        return _INVALID


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _finite_decimal(raw: str) -> Decimal:
    try:
        d = Decimal(raw)
    except InvalidOperation as e:
        raise ValueError(raw) from e
    if not d.is_finite():
        raise ValueError(raw)
    return d


def _reject_constant(raw: str) -> Any:
    raise ValueError(f"non-standard JSON constant {raw}")


def _tag(value: Any) -> tuple[Any, ...]:
    """JSON types kept apart (True vs 1, "1" vs 1), numbers exact, object keys sorted, arrays in order."""
    if value is None:
        return ("null",)
    if type(value) is bool:
        return ("boolean", value)
    if type(value) is str:
        return ("string", value)
    if type(value) is int:
        return ("number", Decimal(value))
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError("non-finite number")
        return ("number", Decimal(str(value)))
    if type(value) is Decimal:
        return ("number", value)
    if type(value) is list:
        return ("array", tuple(_tag(v) for v in value))
    if type(value) is dict:
        if any(type(k) is not str for k in value):
            raise ValueError("object keys must be strings")
        return ("object", tuple(sorted((k, _tag(v)) for k, v in value.items())))
    raise ValueError(f"{type(value).__name__} is not JSON")


BUILTIN_MATCHERS: Final[dict[str, MessageMatcher]] = {
    "strict": strict_message_matches,
    "loose_tool_call": loose_tool_call_message_matches,
    "role_content_only": role_content_only_message_matches,
}


def resolve_message_matcher(selector: str) -> MessageMatcher:
    """A built-in name, or the plain function at import path `selector`; PluginError if neither."""
    if selector in BUILTIN_MATCHERS:
        return BUILTIN_MATCHERS[selector]
    if ":" not in selector and "." not in selector:
        raise PluginError(
            f"unknown message matcher {selector!r}: use one of {', '.join(BUILTIN_MATCHERS)} or an import "
            "path pkg.mod:fn"
        )
    fn = load_object(selector)
    if not callable(fn) or inspect.iscoroutinefunction(fn):
        raise PluginError(f"{selector!r} must be a plain function matches(stored, resent) -> bool")
    return fn  # type: ignore[no-any-return]

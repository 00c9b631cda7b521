"""OpenAI's chat-completions wire format, as the session endpoint reads and writes it (pure functions).

`parse_chat_request(body)` checks a `POST /chat/completions` body and maps it onto SGLang sampling params:
`max_tokens` / `max_completion_tokens` → `max_new_tokens`, `seed` → `sampling_seed`, `min_tokens` →
`min_new_tokens`, and `temperature`, `top_p`, `top_k`, `min_p`, `stop`, `stop_token_ids`, the three
penalties and `ignore_eos` as they are. Messages keep every key the agent sent (matchers decide which
count); a content given as a list of text parts becomes one string. Refused with 400 (never silently
ignored): `n` > 1, `tool_choice` other than "auto"/"none", a `response_format` other than text, images or
audio. Unknown fields are ignored, as OpenAI-compatible servers do.

`completion(...)` is the `chat.completion` answer. Streamed (`StreamHead`), an answer is SSE
`chat.completion.chunk`s: the role, the content in deltas as it is generated (`chunk`), then (`tail`) one
chunk per tool call (`index`, `id`, `type`, `function`, parsed from the whole reply, as OpenAI sends each
call), the finish reason, the usage chunk if `stream_options.include_usage`, and `data: [DONE]`; `whole`
is an answer at once (a reply with no engine call). An error after the stream began is one
`data: {"error": ...}` event (`stream_error`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from miles_aio.inference.wire import encode_json as _encode_json

try:  # msgspec's decoder is several times faster than the stdlib's; optional, as in inference.wire
    import msgspec

    _decode: Any = msgspec.json.Decoder().decode
    _DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, ValueError, RecursionError)
except ImportError:  # pragma: no cover - only without msgspec
    import json

    _decode = json.loads
    _DECODE_ERRORS = (ValueError, RecursionError)

__all__ = [
    "STREAM_DONE",
    "ChatRequest",
    "RequestError",
    "StreamHead",
    "completion",
    "decode_body",
    "encode_json",
    "error_body",
    "parse_chat_request",
    "stream_error",
]

_ROLES: Final = frozenset({"system", "user", "assistant", "tool"})
_TOOL_CHOICES: Final = frozenset({"auto", "none"})
# OpenAI name → SGLang sampling-param name, with the type it must have.
_SAMPLING: Final[dict[str, tuple[str, type | tuple[type, ...]]]] = {
    "temperature": ("temperature", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", int),
    "min_p": ("min_p", (int, float)),
    "seed": ("sampling_seed", int),
    "min_tokens": ("min_new_tokens", int),
    "frequency_penalty": ("frequency_penalty", (int, float)),
    "presence_penalty": ("presence_penalty", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "ignore_eos": ("ignore_eos", bool),
    "stop_token_ids": ("stop_token_ids", list),
}


class RequestError(Exception):
    """A request answered with an OpenAI error body (`error: {message, type, param, code}`)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        err_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.err_type = (
            message,
            status,
            code,
            param,
            err_type,
        )


def error_body(e: RequestError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.err_type, "param": e.param, "code": e.code}}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)
    """SGLang sampling params the request sets (besides max_new_tokens and stop)."""

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls are parsed out of the reply: tools were offered, and not with "none"."""
        return bool(self.tools) and self.tool_choice != "none"


def decode_body(raw: bytes) -> object:
    """A request body's JSON; RequestError (400) if it is not JSON."""
    try:
        return _decode(raw)
    except _DECODE_ERRORS:
        raise RequestError("the request body is not JSON") from None


def parse_chat_request(body: object) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = [_message(m, i) for i, m in enumerate(_field(body, "messages", list, required=True))]
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    tools = _field(body, "tools", list)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise RequestError("every tool must be an object", param="tools")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in _TOOL_CHOICES:
        raise RequestError(
            f"tool_choice={tool_choice!r} is not supported (the session cannot force a tool call); use "
            "'auto' or 'none'",
            param="tool_choice",
        )
    if body.get("n", 1) not in (1, None):
        raise RequestError("n must be 1: a session is one linear conversation", param="n")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError("only response_format {'type': 'text'} is supported", param="response_format")
    for name in ("audio", "modalities", "prediction"):
        if body.get(name) not in (None, ["text"]):
            raise RequestError(f"{name} is not supported", param=name)
    max_tokens = _field(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int)
    if max_tokens is not None and max_tokens <= 0:
        raise RequestError(f"max_tokens must be > 0, got {max_tokens}", param="max_tokens")
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: list[str] = []
    elif isinstance(stop_raw, str):
        stop = [stop_raw]
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = list(stop_raw)
    else:
        raise RequestError("stop must be a string or a list of strings", param="stop")
    sampling: dict[str, Any] = {}
    for name, (sglang_name, kind) in _SAMPLING.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise RequestError(f"{name} has the wrong type ({type(value).__name__})", param=name)
        sampling[sglang_name] = value
    options = _field(body, "stream_options", dict) or {}
    model = body.get("model")
    return ChatRequest(
        messages=messages,
        tools=tools or None,
        tool_choice=str(tool_choice),
        stream=bool(_field(body, "stream", bool)),
        include_usage=bool(options.get("include_usage")),
        max_tokens=max_tokens,
        stop=stop,
        logprobs=bool(_field(body, "logprobs", bool)),
        model=model if isinstance(model, str) else "default",
        sampling=sampling,
    )


def _field(body: Mapping[str, Any], name: str, kind: type, *, required: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"{name} is required", param=name)
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RequestError(f"{name} must be {kind.__name__}, got {type(value).__name__}", param=name)
    return value


def _message(m: object, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object", param=where)
    role = m.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}", param=where)
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise RequestError(f"{where}.content: only text parts are supported", param=where)
            texts.append(part["text"])
        out["content"] = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string, a list of text parts or null", param=where)
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise RequestError(f"{where}.tool_calls must be a list of objects", param=where)
    return out


# ---- answers ---------------------------------------------------------------------------------------------


def completion(
    *,
    rid: str,
    created: int,
    model: str,
    message: Mapping[str, Any],
    finish_reason: str,
    usage: Mapping[str, int],
    logprobs: Sequence[Mapping[str, Any]] | None,
    metadata: Mapping[str, Any],
) -> dict[str, Any]:
    """One `chat.completion` with a single choice."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": dict(message),
                "logprobs": None if logprobs is None else {"content": list(logprobs)},
                "finish_reason": finish_reason,
            }
        ],
        "usage": dict(usage),
        "metadata": dict(metadata),
    }


@dataclass(frozen=True, slots=True)
class StreamHead:
    """One streamed answer: what each of its `chat.completion.chunk`s repeats, and the chunks."""

    rid: str
    created: int
    model: str

    def chunk(
        self,
        delta: Mapping[str, Any],
        finish_reason: str | None = None,
        logprobs: Sequence[Mapping[str, Any]] | None = None,
    ) -> bytes:
        """One SSE chunk with a single choice."""
        lp = None if logprobs is None else {"content": list(logprobs)}
        choice = {"index": 0, "delta": dict(delta), "logprobs": lp, "finish_reason": finish_reason}
        return _sse({**self._fields(), "choices": [choice]})

    def tail(
        self, *, message: Mapping[str, Any], finish_reason: str, usage: Mapping[str, Any], include_usage: bool
    ) -> Iterator[bytes]:
        """The end of the answer: one chunk per tool call (`index`, `id`, `type`, `function`), the finish
        reason, the usage chunk if asked, `data: [DONE]`."""
        for i, call in enumerate(message.get("tool_calls") or []):
            yield self.chunk({"tool_calls": [{"index": i, **call}]})
        yield self.chunk({}, finish_reason=finish_reason)
        if include_usage:
            yield _sse({**self._fields(), "choices": [], "usage": dict(usage)})
        yield STREAM_DONE

    def whole(
        self,
        *,
        message: Mapping[str, Any],
        finish_reason: str,
        usage: Mapping[str, Any],
        include_usage: bool,
        logprobs: Sequence[Mapping[str, Any]] | None,
    ) -> Iterator[bytes]:
        """A whole answer at once: the role, the content, then `tail`."""
        yield self.chunk({"role": "assistant", "content": ""})
        if message.get("content") or logprobs:
            yield self.chunk({"content": message.get("content") or ""}, logprobs=logprobs)
        yield from self.tail(
            message=message, finish_reason=finish_reason, usage=usage, include_usage=include_usage
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
        }


def stream_error(e: RequestError) -> bytes:
    """An error inside a stream whose status line was sent (the `openai` client raises `APIError`)."""
    return _sse(error_body(e))


STREAM_DONE: Final = b"data: [DONE]\n\n"


def encode_json(obj: object) -> bytes:
    """JSON as UTF-8 (msgspec when installed: several times faster than the stdlib here)."""
    return _encode_json(obj)


def _sse(obj: object) -> bytes:
    return b"data: " + _encode_json(obj) + b"\n\n"

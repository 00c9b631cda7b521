"""OpenAI-compatible routes, answering as SGLang's OpenAI layer does (`sglang/srt/entrypoints/openai/`).

    GET  /v1/models                consumes nothing; produces `{"object": "list", "data": [ModelCard]}`, one
                                   card for the served model (`id` = --served-model-name or the model path)
    GET  /v1/models/{model}        that card, or 404 `{"error": {..., "code": "model_not_found"}}`
    POST /v1/completions           consumes a CompletionRequest (`prompt`: a string, a list of token ids,
                                   or a list of either); produces a `text_completion` (`choices[i].text`)
                                   or, with `stream`, SSE chunks of it
    POST /v1/chat/completions      consumes a ChatCompletionRequest (`messages`, roles system/user/
                                   assistant/tool, `tools` rendered by the model's chat template);
                                   produces a `chat.completion` (`choices[i].message`) or, with `stream`,
                                   `chat.completion.chunk` SSE chunks

Responses carry SGLang's fields: `id`, `object`, `created` (unix seconds), `model` (echoed from the
request, "default" if absent), `choices` with `finish_reason` ("stop" / "length" / "abort": the engine's
finish type) and `matched_stop` (the stop string or token id that ended it), `usage` (prompt tokens counted
once per prompt, completion tokens summed over choices) and `metadata: {"weight_version",
"weight_versions"}` (of choice 0). A stream sends `data: {json}\\n\\n` chunks: for chat one role chunk per
choice (`delta: {"role": "assistant", "content": ""}`), content deltas (with their tokens' `logprobs`),
one chunk per choice with its `finish_reason`, then a usage chunk with `choices: []` if
`stream_options.include_usage`, and finally `data: [DONE]\\n\\n`. A completion stream's chunk per step
carries its text delta, logprobs and, on the last one, the finish reason.

Text is the detokenized output (special tokens skipped unless `skip_special_tokens: false`), cut before
a matched stop string unless `no_stop_trim`. While a stream runs, a tail that could still become a stop
string (or an incomplete UTF-8 character) is held back, so a streamed reply assembles to exactly the
non-streamed text.

`n` > 1 runs n independent engine requests on the same prompt ids (rids `<id>_<index>`); with `seed`, choice 0
samples with `seed` itself and choice i with a seed derived from (seed, i), so each has its own generator.

Errors answer SGLang's `ErrorResponse`: `{"object": "error", "message", "type", "param", "code"}` with the
HTTP status as `code`: 400 `"Bad Request"` for a body that breaks the schema (wrong type, missing field),
400 `"BadRequest"` for values the engine refuses (too long a prompt, an unsupported field or option,
which `param` names), 500 `"InternalServerError"`, 503 while the engine shuts down. Fields SGLang accepts
but this engine does not implement (grammars, `response_format` other than text, echo with logprobs,
tool_choice "required" or a named tool, ...) are refused, never silently ignored; unknown fields are
ignored, as SGLang's request models ignore extras.
Tool calls are not parsed out of the reply: a model's tool call arrives as text in `message.content`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import structlog
from aiohttp import web

from miles_aio.chat_template import ChatTemplateError
from miles_aio.engine import protocol as proto
from miles_aio.engine.core import EngineClosed, LogprobOptions, Request
from miles_aio.engine.spans import version_spans
from miles_aio.engine.state import ServerState, read_body

__all__ = ["OpenAIHandlers"]

_log = structlog.get_logger(__name__)
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DEFAULT_MODEL_NAME: Final = "default"  # SGLang's DEFAULT_MODEL_NAME
_COMPLETION_MAX_TOKENS: Final = 16  # CompletionRequest.max_tokens default
_ROLES: Final = ("system", "user", "assistant", "tool")
_SSE_DONE: Final = b"data: [DONE]\n\n"
# Chat sampling defaults: the request's value, else the model's generation_config.json, else these.
_CHAT_SAMPLING_DEFAULTS: Final[dict[str, float | int]] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
}  # fmt: skip

# Request fields handled here (mapped onto SGLang sampling params or used directly).
_COMMON_FIELDS: Final = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "min_tokens", "n", "stop",
     "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
     "stream", "stream_options", "ignore_eos", "skip_special_tokens", "no_stop_trim", "user", "logprobs"}
)  # fmt: skip
_CHAT_FIELDS: Final = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs",
}  # fmt: skip
_COMPLETION_FIELDS: Final = _COMMON_FIELDS | {"prompt", "echo"}
# Fields SGLang accepts whose non-default values this engine cannot honour.
_DEFAULT_ONLY: Final[dict[str, object]] = {
    "response_format": None, "regex": None, "ebnf": None, "json_schema": None, "stop_regex": None,
    "suffix": None, "best_of": None, "continue_final_message": False, "return_hidden_states": False,
    "return_routed_experts": False, "return_token_ids": False, "return_prompt_token_ids": False,
    "return_meta_info": False, "lora_path": None, "session_params": None, "custom_logit_processor": None,
    "custom_params": None, "watermark": None, "input_ids": None, "separate_reasoning": True,
    "stream_reasoning": True, "reasoning_effort": None,
}  # fmt: skip


class _ClientGone(Exception):
    """The streaming client closed its connection."""


class OpenAIError(Exception):
    """An error answered in SGLang's `ErrorResponse` shape."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequest", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def body(self) -> dict[str, Any]:
        return {
            "object": "error",
            "message": self.message,
            "type": self.err_type,
            "param": self.param,
            "code": self.status,
        }


def _schema_error(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, err_type="Bad Request", param=param)  # SGLang's RequestValidationError


def _error_response(exc: OpenAIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _openai_errors(handler: Handler) -> Handler:
    """Answer every failure of `handler` that happens before a stream starts as an OpenAI error."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as exc:
            return _error_response(exc)
        except proto.BadRequest as exc:
            return _error_response(_schema_error(str(exc)) if exc.contract else OpenAIError(str(exc)))
        except EngineClosed as exc:
            return _error_response(OpenAIError(str(exc), status=503, err_type="ServiceUnavailable"))
        except web.HTTPException:
            raise
        except Exception as exc:  # a bug: answer in the OpenAI shape, log the traceback, keep serving
            _log.exception("engine.openai_handler_failed", path=request.path)
            msg = f"Internal server error: {type(exc).__name__}: {exc}"
            return _error_response(OpenAIError(msg, status=500, err_type="InternalServerError"))

    return wrapped


# ---- small typed readers of the request body ----


def _opt(m: Mapping[str, Any], key: str, kind: type[T]) -> T | None:
    value = m.get(key)
    if value is None:
        return None
    if not proto.is_kind(value, kind):
        raise _schema_error(f"invalid type for `{key}`: {value!r}, expected {kind.__name__}", key)
    return float(value) if kind is float else value  # type: ignore[return-value]  # checked above


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _DEFAULT_ONLY:
            default = _DEFAULT_ONLY[key]
            if value in (None, default) or (key == "response_format" and value == {"type": "text"}):
                continue
            raise OpenAIError(f"`{key}`={value!r} is not supported by the embedded engine", param=key)
        # Unknown fields are ignored, as SGLang's request models ignore extras: agent frameworks send
        # fields of newer API versions (`store`, `metadata`, `service_tier`, ...) that change nothing here.
        _log.debug("openai.field_ignored", field=key, request=what)


def _stop_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise _schema_error("invalid type for `stop`: expected a string or a list of strings", "stop")


def _choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 samples with `seed` itself; choice i > 0 with a seed derived from (seed, i)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """A parsed request: what to run (one engine request per choice) and how to answer."""

    model: str
    prompts: list[list[int]]
    n: int
    sampling: dict[str, Any]
    seed: int | None
    max_tokens: int | None
    """None: up to the context length (chat without max_tokens)."""
    logprobs: bool
    top_n: int
    stream: bool
    include_usage: bool
    echo: list[str] | None = None
    """Completions with echo: each prompt's text, put before its choices' text."""


@dataclass(eq=False, kw_only=True)
class _Choice:
    """One engine request of a response, and what of it a stream has sent."""

    index: int
    req: Request
    sent_chars: int = 0
    sent_tokens: int = 0
    opened: bool = False
    """The stream has sent this choice's first chunk (chat: the role; completions: the echo)."""


class OpenAIHandlers:
    """`/v1/models`, `/v1/completions`, `/v1/chat/completions` over the shared `ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.s = state
        self.engine = state.engine
        self._token_text: dict[int, str] = {}
        self._chat_defaults = dict(_CHAT_SAMPLING_DEFAULTS)
        gen_cfg = state.model_path / "generation_config.json"
        try:
            raw = json.loads(gen_cfg.read_text()) if gen_cfg.exists() else {}
        except (OSError, ValueError):
            raw = {}
        for key in _CHAT_SAMPLING_DEFAULTS:
            if isinstance(raw.get(key), int | float) and not isinstance(raw.get(key), bool):
                self._chat_defaults[key] = raw[key]

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", "/v1/models", _openai_errors(self.models)),
            ("GET", "/v1/models/{model:.+}", _openai_errors(self.model)),
            ("POST", "/v1/completions", _openai_errors(self.completions)),
            ("POST", "/v1/chat/completions", _openai_errors(self.chat_completions)),
        ]

    # ---- models ----

    @property
    def served_model_name(self) -> str:
        return self.s.cfg.served_model_name or str(self.s.cfg.model_path)

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.engine.context_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: `{"object": "list", "data": [card]}`, the served model's card."""
        return web.json_response({"object": "list", "data": [self._model_card(self.served_model_name)]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: the card if `model` is the served name, else 404."""
        name = request.match_info["model"]
        if name != self.served_model_name:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return web.json_response({"error": error}, status=404)
        return web.json_response(self._model_card(name))

    # ---- completions ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: CompletionRequest → `text_completion` (or its SSE chunks)."""
        body = await self._body(request, "CompletionRequest")
        _check_fields(body, _COMPLETION_FIELDS, "CompletionRequest")
        prompts, prompt_texts = self._completion_prompts(body.get("prompt"))
        echo = bool(_opt(body, "echo", bool))
        logprobs_n = _opt(body, "logprobs", int)
        if logprobs_n is not None and logprobs_n < 0:
            raise OpenAIError(f"logprobs must be >= 0, got {logprobs_n}", param="logprobs")
        if echo and logprobs_n is not None:
            raise OpenAIError(
                "echo with logprobs (prompt logprobs) is not supported by the embedded engine; "
                "use the native /generate with logprob_start_len",
                param="echo",
            )
        max_tokens = _opt(body, "max_tokens", int)
        job = self._job(
            body,
            prompts=prompts,
            max_tokens=_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
            logprobs=logprobs_n is not None,
            top_n=logprobs_n or 0,
            defaults={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
            echo=(
                [t if t is not None else self.s.decode(p) for t, p in zip(prompt_texts, prompts, strict=True)]
                if echo
                else None
            ),
        )
        rid, choices = self._start(job)
        if job.stream:
            return await self._stream(request, job, rid, choices, self._completion_chunks, "text_completion")
        results = await self._finish_all(choices)
        out = []
        for c in results:
            r = c.req
            text = self._text(r)
            if job.echo is not None:
                text = job.echo[c.index // job.n] + text
            out.append(
                {
                    "index": c.index,
                    "text": text,
                    "logprobs": self._completion_logprobs(r, 0, len(r.output_ids)) if job.logprobs else None,
                    "finish_reason": _finish_type(r),
                    "matched_stop": _matched(r),
                }
            )
        return web.json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": job.model,
                "choices": out,
                "usage": self._response_usage(job, results),
                "metadata": self._metadata(results[0].req),
            }
        )

    def _completion_prompts(self, raw: object) -> tuple[list[list[int]], list[str | None]]:
        """`prompt` → token ids per prompt, and each prompt's text where it was given as text."""
        if raw is None:
            raise _schema_error("missing field `prompt`", "prompt")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and proto.is_kind(raw[0], int)):
            items: list[object] = [raw]
        elif isinstance(raw, list):
            items = list(raw)
        else:
            raise _schema_error("invalid type for `prompt`: expected a string, token ids, or a list of them")
        if not items or all(not p for p in items):
            raise OpenAIError("Prompt cannot be empty", param="prompt")  # SGLang's wording
        ids: list[list[int]] = []
        texts: list[str | None] = []
        for p in items:
            if isinstance(p, str):
                ids.append(self._encode(p, add_special_tokens=True))
                texts.append(p)
            elif isinstance(p, list) and all(proto.is_kind(t, int) for t in p):
                ids.append(list(p))
                texts.append(None)
            else:
                raise _schema_error(
                    "invalid type for `prompt`: expected a string, token ids, or a list of them", "prompt"
                )
            if not ids[-1]:
                raise OpenAIError("a prompt encodes to no tokens", param="prompt")
        return ids, texts

    def _completion_logprobs(self, r: Request, start: int, end: int) -> dict[str, Any]:
        """SGLang's `LogProbs` (legacy completions shape) for output tokens start..end."""
        ids = r.output_ids[start:end]
        top = r.output_top_logprobs[start:end] if r.logprobs.top_n else []
        return {
            "text_offset": [-1] * len(ids),
            "token_logprobs": r.output_logprobs[start:end],
            "tokens": [self._tok(t) for t in ids],
            "top_logprobs": [{self._tok(t): lp for lp, t in row} for row in top],
        }

    def _completion_chunks(self, job: _Job, c: _Choice, created: int, rid: str) -> Iterator[bytes]:
        r, n = c.req, len(c.req.output_ids)
        delta = self._delta(c)
        if job.echo is not None and not c.opened:
            delta = job.echo[c.index // job.n] + delta
        c.opened = True
        logprobs = self._completion_logprobs(r, c.sent_tokens, n) if job.logprobs else None
        c.sent_tokens = n
        choice = {
            "index": c.index,
            "text": delta,
            "logprobs": logprobs,
            "finish_reason": _finish_type(r) if r.finished else None,
            "matched_stop": _matched(r) if r.finished else None,
        }
        yield _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": job.model,
                "choices": [choice],
                "usage": None,
            }
        )

    # ---- chat ----

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: ChatCompletionRequest → `chat.completion` (or its SSE chunks)."""
        body = await self._body(request, "ChatCompletionRequest")
        _check_fields(body, _CHAT_FIELDS, "ChatCompletionRequest")
        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "none", "auto"):
            raise OpenAIError(
                f"tool_choice={tool_choice!r} is not supported by the embedded engine (it cannot force a "
                "tool call); use 'auto' or 'none'",
                param="tool_choice",
            )
        template_kwargs = _opt(body, "chat_template_kwargs", dict) or {}
        if reserved := {"chat_template", "messages", "tools", "add_generation_prompt"} & set(template_kwargs):
            raise OpenAIError(
                f"chat_template_kwargs.{sorted(reserved)[0]} is not allowed", param="chat_template_kwargs"
            )
        if self.s.chat_template is None:
            raise OpenAIError(
                "this model has no chat template (no chat_template in tokenizer_config.json); "
                "use /v1/completions",
                param="messages",
            )
        try:
            text = self.s.chat_template.render(
                messages, tools=tools if tool_choice != "none" else None, **template_kwargs
            )
        except ChatTemplateError as exc:
            raise OpenAIError(str(exc), param="messages") from exc
        prompt = self._encode(text, add_special_tokens=False)
        if not prompt:
            raise OpenAIError("the rendered chat encodes to no tokens", param="messages")
        logprobs = bool(_opt(body, "logprobs", bool))
        top_logprobs = _opt(body, "top_logprobs", int)
        if top_logprobs is not None and top_logprobs < 0:
            raise OpenAIError(f"top_logprobs must be >= 0, got {top_logprobs}", param="top_logprobs")
        max_tokens = _opt(body, "max_completion_tokens", int) or _opt(body, "max_tokens", int)
        if max_tokens is not None and max_tokens > self.engine.context_len:
            raise OpenAIError(  # SGLang's wording (sic: no space after the period)
                f"max_completion_tokens is too large: {max_tokens}."
                f"This model supports at most {self.engine.context_len} completion tokens.",
                param="max_completion_tokens",
            )
        job = self._job(
            body,
            prompts=[prompt],
            max_tokens=max_tokens,
            logprobs=logprobs,
            top_n=(top_logprobs or 0) if logprobs else 0,
            defaults=self._chat_defaults,
        )
        rid, choices = self._start(job)
        if job.stream:
            return await self._stream(request, job, rid, choices, self._chat_chunks, "chat.completion.chunk")
        results = await self._finish_all(choices)
        out = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": self._text(c.req), "reasoning_content": None},
                "logprobs": (
                    {"content": self._chat_logprobs(c.req, 0, len(c.req.output_ids))}
                    if job.logprobs
                    else None
                ),
                "finish_reason": _finish_type(c.req),
                "matched_stop": _matched(c.req),
            }
            for c in results
        ]
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": job.model,
                "choices": out,
                "usage": self._response_usage(job, results),
                "metadata": self._metadata(results[0].req),
            }
        )

    def _chat_logprobs(self, r: Request, start: int, end: int) -> list[dict[str, Any]]:
        """`logprobs.content` entries `{token, bytes, logprob, top_logprobs}` for output tokens start..end."""
        entries = []
        for i in range(start, end):
            tok = self._tok(r.output_ids[i])
            top = r.output_top_logprobs[i] if r.logprobs.top_n and i < len(r.output_top_logprobs) else []
            entries.append(
                {
                    "token": tok,
                    "bytes": list(tok.encode()),
                    "logprob": r.output_logprobs[i],
                    "top_logprobs": [
                        {"token": self._tok(t), "bytes": list(self._tok(t).encode()), "logprob": lp}
                        for lp, t in top
                    ],
                }
            )
        return entries

    def _chat_chunk(self, job: _Job, rid: str, created: int, index: int, **kw: Any) -> bytes:
        """One `chat.completion.chunk` as SGLang's `build_sse_content` writes it."""
        delta: dict[str, Any] = {"reasoning_content": None}
        for key in ("role", "content"):
            if kw.get(key) is not None:
                delta[key] = kw[key]
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": kw.get("logprobs"),
            "finish_reason": kw.get("finish_reason"),
            "matched_stop": kw.get("matched_stop"),
        }
        chunk = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": job.model,
            "choices": [choice],
        }
        return _sse(chunk)

    def _chat_chunks(self, job: _Job, c: _Choice, created: int, rid: str) -> Iterator[bytes]:
        r, n = c.req, len(c.req.output_ids)
        if not c.opened:
            c.opened = True
            yield self._chat_chunk(job, rid, created, c.index, role="assistant", content="")
        delta = self._delta(c)
        if delta:  # logprobs ride on content chunks; tokens without text wait for the next one
            logprobs = {"content": self._chat_logprobs(r, c.sent_tokens, n)} if job.logprobs else None
            c.sent_tokens = n
            yield self._chat_chunk(job, rid, created, c.index, content=delta, logprobs=logprobs)
        if r.finished:
            rest = (
                {"content": self._chat_logprobs(r, c.sent_tokens, n)}
                if job.logprobs and n > c.sent_tokens
                else None
            )
            c.sent_tokens = n
            yield self._chat_chunk(
                job,
                rid,
                created,
                c.index,
                finish_reason=_finish_type(r),
                matched_stop=_matched(r),
                logprobs=rest,
            )

    # ---- shared ----

    async def _body(self, request: web.Request, what: str) -> dict[str, Any]:
        body = await read_body(request)
        if not isinstance(body, dict):
            raise _schema_error(f"invalid type: expected {what} (a JSON object)")
        return body

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if self.s.tokenizer is None:
            raise OpenAIError("text input needs a tokenizer.json in the model dir; send token ids")
        return list(self.s.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _tok(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.s.decode([token_id], skip_special_tokens=False)
        return text

    def _job(
        self,
        body: Mapping[str, Any],
        *,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: bool,
        top_n: int,
        defaults: Mapping[str, float | int],
        echo: list[str] | None = None,
    ) -> _Job:
        n = _opt(body, "n", int)
        n = 1 if n is None else n
        if n < 1:
            raise OpenAIError(f"n must be at least 1, got {n}", param="n")
        stream_options = _opt(body, "stream_options", dict) or {}
        if stream_options.get("continuous_usage_stats"):
            raise OpenAIError(
                "stream_options.continuous_usage_stats is not supported by the embedded engine",
                param="stream_options",
            )
        if max_tokens is not None and max_tokens < 0:
            raise OpenAIError(f"max_tokens must be at least 0, got {max_tokens}", param="max_tokens")

        def pick(key: str) -> object:
            value = body.get(key)
            return defaults[key] if value is None else value

        sampling: dict[str, Any] = {
            "temperature": pick("temperature"),
            "top_p": pick("top_p"),
            "top_k": pick("top_k"),
            "min_p": pick("min_p"),
            "repetition_penalty": pick("repetition_penalty"),
            "frequency_penalty": body.get("frequency_penalty"),
            "presence_penalty": body.get("presence_penalty"),
            "min_new_tokens": body.get("min_tokens"),
            "logit_bias": body.get("logit_bias"),
            "stop": _stop_list(body.get("stop")),
            "stop_token_ids": body.get("stop_token_ids"),
            "ignore_eos": body.get("ignore_eos"),
            "skip_special_tokens": body.get("skip_special_tokens"),
            "no_stop_trim": body.get("no_stop_trim"),
        }
        sampling = {k: v for k, v in sampling.items() if v is not None}
        return _Job(
            model=_opt(body, "model", str) or DEFAULT_MODEL_NAME,
            prompts=prompts,
            n=n,
            sampling=sampling,
            seed=_opt(body, "seed", int),
            max_tokens=max_tokens,
            logprobs=logprobs,
            top_n=top_n,
            stream=bool(_opt(body, "stream", bool)),
            include_usage=bool(stream_options.get("include_usage")),
            echo=echo,
        )

    def _start(self, job: _Job) -> tuple[str, list[_Choice]]:
        """The response id and every choice's engine request, validated (BadRequest → 400 before any runs)."""
        base = uuid.uuid4().hex
        choices = []
        total = len(job.prompts) * job.n
        for p, prompt in enumerate(job.prompts):
            for j in range(job.n):
                index = p * job.n + j
                max_new = (
                    job.max_tokens if job.max_tokens is not None else self.engine.context_len - len(prompt)
                )
                params = proto.parse_sampling_params(
                    {
                        **job.sampling,
                        "max_new_tokens": max(max_new, 0),
                        "sampling_seed": _choice_seed(job.seed, j),
                    }
                )
                req = self.engine.new_request(
                    rid=base if total == 1 else f"{base}_{index}",
                    prompt_ids=prompt,
                    params=params,
                    logprobs=LogprobOptions(top_n=job.top_n),
                )
                choices.append(_Choice(index=index, req=req))
        return base, choices

    async def _finish_all(self, choices: list[_Choice]) -> list[_Choice]:
        await asyncio.gather(*(self.engine.generate(c.req) for c in choices))
        if failed := [c.req.error for c in choices if c.req.error is not None]:
            raise OpenAIError(
                f"Internal server error: {failed[0]}", status=500, err_type="InternalServerError"
            )
        return choices

    def _text(self, r: Request) -> str:
        """The reply text, as the native /generate answers it: stop string trimmed unless no_stop_trim."""
        text = self.s.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        if (
            r.matched_stop is not None
            and not r.params.no_stop_trim
            and (cut := text.find(r.matched_stop)) >= 0
        ):
            text = text[:cut]
        return text

    def _delta(self, c: _Choice) -> str:
        """Text not yet sent: all of it once finished, else what can no longer change or become a stop."""
        r = c.req
        if r.finished:
            text = self._text(r)
        else:
            text = self.s.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character
            hold = max(
                (
                    k
                    for s in r.params.stop
                    for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])
                ),
                default=0,
            )
            text = text[: len(text) - hold]
        if len(text) <= c.sent_chars:
            return ""
        delta, c.sent_chars = text[c.sent_chars :], len(text)
        return delta

    def _response_usage(self, job: _Job, choices: Sequence[_Choice]) -> dict[str, Any]:
        prompt = sum(len(c.req.prompt_ids) for c in choices if c.index % job.n == 0)
        return _usage(prompt, sum(len(c.req.output_ids) for c in choices))

    def _metadata(self, r: Request) -> dict[str, Any]:
        spans = version_spans(r.output_versions, current=self.engine.weight_version)
        return {"weight_version": spans[-1]["version"], "weight_versions": spans}

    async def _stream(
        self,
        request: web.Request,
        job: _Job,
        rid: str,
        choices: list[_Choice],
        chunks: Callable[[_Job, _Choice, int, str], Iterator[bytes]],
        obj: str,
    ) -> web.StreamResponse:
        """Run every choice, writing its chunks as it progresses; then the usage chunk and [DONE]."""
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        created = int(time.time())
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for _ in self.engine.stream(c.req):
                    if c.req.error is not None:
                        err = OpenAIError(
                            f"Internal server error: {c.req.error}",
                            status=500,
                            err_type="InternalServerError",
                        )
                        queue.put_nowait(_sse({"error": err.body()}))
                        break
                    for chunk in chunks(job, c, created, rid):
                        queue.put_nowait(chunk)
            finally:
                queue.put_nowait(None)

        async def write_all() -> None:
            """Write each choice's chunks as its pump queues them, then usage and [DONE]."""
            try:
                for _ in choices:
                    while (item := await queue.get()) is not None:
                        await resp.write(item)
                if job.include_usage:
                    usage = self._response_usage(job, choices)
                    if obj == "text_completion":  # SGLang dumps this one with exclude_none
                        usage = {k: v for k, v in usage.items() if v is not None}
                    chunk = {"id": rid, "object": obj, "created": created, "model": job.model, "choices": []}
                    await resp.write(_sse(chunk | {"usage": usage}))
                await resp.write(_SSE_DONE)
            except ConnectionResetError:
                raise _ClientGone from None

        failure: BaseException | None = None
        try:
            # The pumps and the writer share one TaskGroup: a client that leaves (or a cancelled handler)
            # cancels the pumps, and each pump's stream aborts its request.
            async with asyncio.TaskGroup() as tg:
                for c in choices:
                    tg.create_task(pump(c), name=f"openai-stream-{c.req.rid}")
                await write_all()
        except* _ClientGone:
            failure = _ClientGone()
        except* Exception as group:  # a bug while streaming: told to the client in-band below
            failure = group.exceptions[0]
        if isinstance(failure, _ClientGone):
            return resp
        if failure is not None:  # as SGLang does: an error chunk, then [DONE]
            _log.error("engine.openai_stream_failed", path=request.path, exc_info=failure)
            msg = f"Internal server error: {failure}"
            err = OpenAIError(msg, status=500, err_type="InternalServerError")
            try:
                await resp.write(_sse({"error": err.body()}))
                await resp.write(_SSE_DONE)
            except ConnectionResetError:
                return resp
        await resp.write_eof()
        return resp


def _finish_type(r: Request) -> str | None:
    return r.finish_reason["type"] if r.finish_reason else None


def _matched(r: Request) -> str | int | None:
    matched: str | int | None = r.finish_reason.get("matched") if r.finish_reason else None
    return matched


def _messages(raw: object) -> list[dict[str, Any]]:
    """Messages as the template sees them: roles checked, text parts joined, None fields dropped."""
    if raw is None:
        raise _schema_error("missing field `messages`", "messages")
    if not isinstance(raw, list):
        raise _schema_error("invalid type for `messages`: expected a list of messages", "messages")
    if not raw:
        raise OpenAIError("Messages cannot be empty.", param="messages")  # SGLang's wording
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _schema_error(f"invalid type for `messages[{i}]`: expected an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise OpenAIError(
                f"messages[{i}].role={role!r} is not supported; expected one of {list(_ROLES)}",
                param="messages",
            )
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIError(
                        f"messages[{i}].content part of type {kind!r} is not supported (text only)",
                        param="messages",
                    )
                if not isinstance(part.get("text"), str):
                    raise _schema_error(
                        f"messages[{i}].content: a text part needs a string `text`", "messages"
                    )
                parts.append(part["text"])
            content = " ".join(parts)  # SGLang's 'string' content format
        elif content is not None and not isinstance(content, str):
            raise _schema_error(f"invalid type for `messages[{i}].content`", "messages")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = content or ""
        out.append(msg)
    return out


def _tools(raw: object) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _schema_error("invalid type for `tools`: expected a list of tools", "tools")
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _schema_error(f"tools[{i}] needs a `function` with a string `name`", "tools")
        if tool.get("type", "function") != "function":
            raise OpenAIError(f"tools[{i}].type={tool.get('type')!r} is not supported", param="tools")
    return raw or None

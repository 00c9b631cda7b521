"""The SGLang `/generate` wire contract, as the client reads it: JSON codec, policy versions on the wire,
strict validation of answers, and joining the pieces of a partially rolled-out generation.

Field names and shapes follow SGLang's own schema (`sglang/api/v1/api_types.py`: `GenerateResponse`,
`GenerateMetaInfo`, `LogprobEntry` as `[logprob, token_id, text]`, `WeightVersionSpan` as half-open
`{version, start, end}` output-token spans) and `sglang/srt/utils/weight_versions.py`. Everything that breaks
it raises `EngineBadResponse` with a message naming the field, never a half-built output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final

import httpx
import msgspec  # a dependency (pyproject): StreamDecoder needs its typed decoding

from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable
from miles_aio.inference.base import GenerateChunk
from miles_aio.types import FinishReason, GenerateOutput

try:  # msgspec's JSON codec is ~5x faster than the stdlib's on token-id lists
    encode_json: Callable[[object], bytes] = msgspec.json.Encoder().encode
    _decode_json: Callable[[bytes], object] = msgspec.json.Decoder().decode
    _JSON_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, ValueError, RecursionError)
except ImportError:  # pragma: no cover - only without msgspec
    encode_json = lambda obj: json.dumps(obj, separators=(",", ":")).encode()  # noqa: E731
    _decode_json = json.loads
    _JSON_ERRORS = (ValueError, RecursionError)  # RecursionError: nested too deep

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "MAX_TOKEN_ID",
    "ROUTING_KEY_HEADER",
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "StreamDecoder",
    "decode_generate_response",
    "decode_json_object",
    "decode_json_value",
    "encode_json",
    "error_text",
    "http_error",
    "join_pieces",
    "parse_generate_response",
    "parse_wire_version",
    "stream_error",
    "transport_error",
    "wire_version",
]

ROUTING_KEY_HEADER: Final = "X-SMG-Routing-Key"
"""Header that sglang-router / sgl-model-gateway reads for consistent-hash routing (sticky prefixes)."""
DEFAULT_WEIGHT_VERSION: Final = "default"
"""What SGLang reports before anyone stamped a version; miles_aio reads it as None (unknown)."""
SGLANG_DEFAULT_MAX_NEW_TOKENS: Final = 128
"""SGLang's `SamplingParams.max_new_tokens` default, needed to size partial-rollout continuations."""
_FINISH_TYPES: Final = frozenset({"stop", "length", "abort"})
MAX_TOKEN_ID: Final = 2**31
"""Token ids are in [0, MAX_TOKEN_ID): a trainer packs them into int32/int64 tensors; others are corrupt."""


def wire_version(version: int) -> str:
    """A policy version as SGLang carries it: a decimal string."""
    if version < 0:
        raise ValueError(f"policy versions are >= 0, got {version}")
    return str(version)


def parse_wire_version(raw: object, where: str) -> int | None:
    """A policy version from the wire: `"default"` is None (unknown), a decimal string is an int."""
    if raw == DEFAULT_WEIGHT_VERSION:
        return None
    if isinstance(raw, str) and raw.isascii() and raw.isdecimal() and len(raw) <= 18:
        return int(raw)
    raise EngineBadResponse(f"{where}: weight version {_short(raw)} is not a decimal string or 'default'")


def _short(value: object) -> str:
    """repr() cut to 80 characters: error messages must stay readable whatever the server sent."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _require(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    """obj[key], which must be of type `kind` exactly (so a bool is not an int)."""
    if key not in obj:
        raise EngineBadResponse(f"{where}: missing field {key!r}")
    if type(value := obj[key]) is not kind:
        raise EngineBadResponse(f"{where}: field {key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _expand_versions(meta: Mapping[str, Any], n: int, where: str) -> list[int | None]:
    """One version per output token, from `weight_versions` spans or the single `weight_version`."""
    spans = meta.get("weight_versions")
    if spans is None or spans == []:
        return [parse_wire_version(_require(meta, "weight_version", str, where), where)] * n
    if type(spans) is not list:
        raise EngineBadResponse(f"{where}: weight_versions must be a list, got {type(spans).__name__}")
    out: list[int | None] = []
    for i, span in enumerate(spans):  # half-open [start, end) spans that tile the output
        start, end = (span.get("start"), span.get("end")) if type(span) is dict else (None, None)
        if type(start) is not int or type(end) is not int or start != len(out) or not start <= end <= n:
            raise EngineBadResponse(
                f"{where}: weight_versions[{i}]={_short(span)} does not continue at {len(out)} (of {n})"
            )
        out.extend([parse_wire_version(span.get("version"), where)] * (end - start))
    if len(out) != n:
        raise EngineBadResponse(f"{where}: weight_versions spans cover {len(out)} tokens, output has {n}")
    return out


def parse_generate_response(body: object, *, where: str) -> GenerateOutput:
    """Validate one non-streaming `/generate` answer and decode it; raise `EngineBadResponse` if it breaks
    the contract (missing fields, wrong types, logprob count or token ids disagreeing with output_ids)."""
    if type(body) is not dict:
        raise EngineBadResponse(f"{where}: expected a JSON object, got {type(body).__name__}")
    text = _require(body, "text", str, where)
    output_ids: list[Any] = _require(body, "output_ids", list, where)
    meta = _require(body, "meta_info", dict, where)
    raw_finish: object = _require(meta, "finish_reason", dict, where).get("type")
    if type(raw_finish) is not str or raw_finish not in _FINISH_TYPES:  # type() first: [] is unhashable
        raise EngineBadResponse(f"{where}: finish_reason.type {_short(raw_finish)} is not stop|length|abort")
    finish: FinishReason = raw_finish  # type: ignore[assignment]
    prompt_tokens = _require(meta, "prompt_tokens", int, where)
    cached_tokens = _require(meta, "cached_tokens", int, where) if "cached_tokens" in meta else 0
    entries: list[Any] = _require(meta, "output_token_logprobs", list, where)
    n = len(output_ids)
    if len(entries) != n:
        raise EngineBadResponse(f"{where}: {len(entries)} output_token_logprobs for {n} output_ids")
    log_probs: list[float] = []
    for i in range(n):  # hot loop: exact type checks, no helper calls
        entry, token_id = entries[i], output_ids[i]
        if type(token_id) is not int or not 0 <= token_id < MAX_TOKEN_ID:
            raise EngineBadResponse(f"{where}: output_ids[{i}]={_short(token_id)} is not a token id")
        if type(entry) is not list or len(entry) != 3:
            raise EngineBadResponse(
                f"{where}: output_token_logprobs[{i}]={_short(entry)} is not [logprob,id,text]"
            )
        lp = entry[0]
        if (type(lp) is not float and type(lp) is not int) or lp != lp:
            raise EngineBadResponse(
                f"{where}: output_token_logprobs[{i}] logprob {_short(lp)} is not a number"
            )
        if entry[1] != token_id or type(entry[1]) is not int:
            raise EngineBadResponse(
                f"{where}: output_token_logprobs[{i}] has token id {_short(entry[1])}, "
                f"output_ids has {token_id}"
            )
        log_probs.append(float(lp))
    versions = _expand_versions(meta, n, where)
    extra = {k: v for k, v in meta.items() if k not in ("output_token_logprobs", "weight_versions")}
    return GenerateOutput(
        text=text,
        output_ids=output_ids,
        output_log_probs=log_probs,
        meta=extra,
        weight_versions=versions,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
    )


_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]


class _Answer(msgspec.Struct):
    """A `/generate` answer as the fast path decodes it: the meta_info's values stay raw JSON until read."""

    text: str
    output_ids: list[_TokenId]
    meta_info: dict[str, msgspec.Raw]


_decode_answer = msgspec.json.Decoder(_Answer).decode
_decode_entries = msgspec.json.Decoder(list[tuple[float, _TokenId, Any]]).decode
_FAST_PATH_MISSES = (msgspec.ValidationError, msgspec.DecodeError, KeyError, RecursionError)


def decode_generate_response(body: bytes, *, where: str) -> GenerateOutput:
    """`parse_generate_response(decode_json_object(body))`, faster: the answer is decoded into typed
    fields, so msgspec checks the token ids and the `[logprob, id, text]` triples in C while it reads them
    (a 1,000-token answer: ~270 → ~165 µs, and no list per token for the collector to walk). It accepts
    no more than `parse_generate_response` does; whatever it does not take (a missing or ill-typed
    field, an id out of range) goes to `parse_generate_response`, which words the error."""
    try:
        answer = _decode_answer(body)
        raw_meta = answer.meta_info
        entries = _decode_entries(raw_meta["output_token_logprobs"])
        meta = {k: _decode_json(v) for k, v in raw_meta.items() if k != "output_token_logprobs"}
    except _FAST_PATH_MISSES:
        return parse_generate_response(decode_json_object(body, where), where=where)
    output_ids, finish = answer.output_ids, meta.get("finish_reason")
    raw_finish = finish.get("type") if type(finish) is dict else None
    prompt_tokens, cached = meta.get("prompt_tokens"), meta.get("cached_tokens", 0)
    if (
        type(raw_finish) is not str
        or raw_finish not in _FINISH_TYPES
        or type(prompt_tokens) is not int
        or type(cached) is not int
        or len(entries) != len(output_ids)
        or [e[1] for e in entries] != output_ids  # (msgspec decodes no JSON number to NaN)
    ):
        return parse_generate_response(decode_json_object(body, where), where=where)
    versions = _expand_versions(meta, len(output_ids), where)
    meta.pop("weight_versions", None)
    return GenerateOutput(
        text=answer.text,
        output_ids=output_ids,
        output_log_probs=[e[0] for e in entries],
        meta=meta,
        weight_versions=versions,
        finish_reason=raw_finish,  # type: ignore[arg-type]
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
    )


class _StreamMeta(msgspec.Struct):
    finish_reason: object = None
    output_token_logprobs: msgspec.Raw = msgspec.Raw(b"null")
    weight_versions: object = None
    weight_version: object = None


class _StreamChunk(msgspec.Struct):
    output_ids: msgspec.Raw = msgspec.Raw(b"null")
    meta_info: _StreamMeta | None = None
    error: object = None


_decode_stream_chunk = msgspec.json.Decoder(_StreamChunk).decode


class StreamDecoder:
    """The `data:` chunks of one streaming `/generate`, in SGLang's default (cumulative) form: every chunk
    carries `output_ids` and `meta_info.output_token_logprobs` for all tokens so far.

    `feed(data)` returns the tokens a chunk adds (checked as `parse_generate_response` checks them) and,
    for the last chunk (its `finish_reason` is set), the whole answer parsed by `decode_generate_response`,
    which must be exactly the chunks joined (ids, log-probs, versions). Only what a chunk adds is decoded:
    the bytes of its two arrays must start with the previous chunk's (compared, not decoded again), so an
    n-token stream costs O(n) decoding, not O(n²); a chunk whose arrays are spelled differently is decoded
    whole. A chunk that does not extend the previous one (`--incremental-streaming-output` sends deltas:
    not supported) is `EngineBadResponse`; an error event is `stream_error`'s exception."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.output_ids: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[int | None] = []
        self._ids_raw = b""
        self._lps_raw = b""

    def feed(self, data: bytes) -> tuple[GenerateChunk, GenerateOutput | None]:
        where, have = self.where, len(self.output_ids)
        try:
            c = _decode_stream_chunk(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:  # Recursion: too deep
            raise EngineBadResponse(f"{where}: invalid stream chunk ({e}); it starts {data[:80]!r}") from e
        if c.error is not None:
            raise stream_error(c.error, where)
        meta = c.meta_info
        ids_raw, lps_raw = bytes(c.output_ids), bytes(meta.output_token_logprobs) if meta else b"null"
        if meta is None or ids_raw == b"null" or lps_raw == b"null":
            raise EngineBadResponse(f"{where}: stream chunk without output_ids or output_token_logprobs")
        ids = self._added(ids_raw, self._ids_raw, "output_ids")
        entries = self._added(lps_raw, self._lps_raw, "output_token_logprobs")
        if len(entries) != len(ids):
            raise EngineBadResponse(
                f"{where}: a stream chunk adds {len(entries)} log-probs to {len(ids)} ids"
            )
        log_probs: list[float] = []
        for k in range(len(ids)):
            i, entry, token_id = have + k, entries[k], ids[k]
            if type(token_id) is not int or not 0 <= token_id < MAX_TOKEN_ID:
                raise EngineBadResponse(f"{where}: output_ids[{i}]={_short(token_id)} is not a token id")
            if type(entry) is not list or len(entry) != 3 or entry[1] != token_id:
                raise EngineBadResponse(
                    f"{where}: output_token_logprobs[{i}]={_short(entry)} is not [logprob,{token_id},text]"
                )
            lp = entry[0]
            if (type(lp) is not float and type(lp) is not int) or lp != lp:
                raise EngineBadResponse(f"{where}: output_token_logprobs[{i}]: {_short(lp)} is not a number")
            log_probs.append(float(lp))
        n = have + len(ids)
        version_meta = {
            k: v
            for k, v in (("weight_versions", meta.weight_versions), ("weight_version", meta.weight_version))
            if v is not None
        }
        versions = _expand_versions(version_meta, n, where)[have:]
        self._ids_raw, self._lps_raw = ids_raw, lps_raw
        self.output_ids += ids
        self.log_probs += log_probs
        self.versions += versions
        chunk = GenerateChunk(output_ids=ids, output_log_probs=log_probs, weight_versions=versions)
        if meta.finish_reason is None:
            return chunk, None
        out = decode_generate_response(data, where=where)
        if (out.output_ids, out.output_log_probs, out.weight_versions) != (
            self.output_ids,
            self.log_probs,
            self.versions,
        ):
            raise EngineBadResponse(f"{where}: the last stream chunk is not the chunks before it joined")
        return chunk, out

    def _added(self, raw: bytes, prev: bytes, name: str) -> list[Any]:
        """The items of JSON array `raw` after the first `len(self.output_ids)`."""
        have = len(self.output_ids)
        if have and raw.startswith(prev[:-1]):  # prev is "[...]": the same items, then more
            rest = raw[len(prev) - 1 :].lstrip()
            if rest.startswith(b","):
                items = _decode_json(b"[" + rest[1:])  # valid: the chunk's decode checked `raw`
                if type(items) is list:
                    return items
            elif rest.rstrip() == b"]":
                return []
        try:
            items = _decode_json(raw)
        except _JSON_ERRORS as e:
            raise EngineBadResponse(f"{self.where}: stream chunk {name} is not JSON ({e})") from e
        if type(items) is not list:
            raise EngineBadResponse(
                f"{self.where}: stream chunk {name} is {type(items).__name__}, not a list"
            )
        if len(items) < have:
            raise EngineBadResponse(
                f"{self.where}: stream chunk has {len(items)} {name} after {have}: chunks must be cumulative "
                "(SGLang's default; --incremental-streaming-output is not supported)"
            )
        return items[have:]


def stream_error(err: object, where: str) -> EngineError:
    """An error event of a stream (`{"error": {"message", "code"?}}`): a 5xx code is the server's failure
    (EngineUnavailable, as an HTTP 5xx); otherwise the request's (SGLang sends a ValueError's message
    without a code, where a plain `/generate` would answer 400): EngineBadResponse."""
    message = err.get("message", err) if isinstance(err, dict) else err
    code = err.get("code") if isinstance(err, dict) else None
    kind = EngineUnavailable if isinstance(code, int) and code >= 500 else EngineBadResponse
    return kind(f"{where}: error event: {str(message)[:500]}")


def join_pieces(pieces: list[GenerateOutput], *, max_new_tokens: int) -> GenerateOutput:
    """The pieces of one partially rolled-out generation as one output (versions stay per token)."""
    last = pieces[-1]
    ids = [t for p in pieces for t in p.output_ids]
    finish: FinishReason = (
        "length" if last.finish_reason == "abort" and len(ids) >= max_new_tokens else (last.finish_reason)
    )
    return GenerateOutput(
        text="".join(p.text for p in pieces),
        output_ids=ids,
        finish_reason=finish,
        output_log_probs=[lp for p in pieces for lp in p.output_log_probs],
        weight_versions=[v for p in pieces for v in p.weight_versions],
        prompt_tokens=pieces[0].prompt_tokens,
        cached_tokens=sum(p.cached_tokens for p in pieces),
        meta={**last.meta, "partial_rollout_segments": len(pieces)},
    )


def decode_json_value(body: bytes, where: str) -> object:
    """Decode an answer that must be JSON; raise EngineBadResponse otherwise."""
    try:
        return _decode_json(body)
    except _JSON_ERRORS as e:
        raise EngineBadResponse(f"{where}: invalid JSON ({e}); body starts {body[:80]!r}") from e


def decode_json_object(body: bytes, where: str) -> dict[str, Any]:
    """Decode an answer that must be a JSON object; raise EngineBadResponse otherwise."""
    data = decode_json_value(body, where)
    if type(data) is not dict:
        raise EngineBadResponse(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def error_text(body: bytes) -> str:
    """A server's error message from an error answer's body: SGLang's {"error": {"message": ...}},
    {"error": "..."} or ErrorResponse {"object": "error", "message": ...}; vLLM's and FastAPI's
    {"detail": ...}; else the start of the body."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return body[:200].decode(errors="replace") or "(empty body)"
    if isinstance(data, dict):
        data = data.get("error", data.get("detail", data.get("message", data)))
    return str(data.get("message", data) if isinstance(data, dict) else data)[:500]


def http_error(where: str, status: int, body: bytes, hint: str = "") -> EngineError:
    """The error of a 4xx/5xx answer to `where` (`url/path`): a 5xx is the server's trouble
    (EngineUnavailable: the router may retry elsewhere), a 4xx refuses what was sent (EngineBadResponse)."""
    kind = EngineUnavailable if status >= 500 else EngineBadResponse
    return kind(f"{where}: HTTP {status}: {error_text(body)}{hint}")


def transport_error(where: str, e: httpx.TransportError, *, lost: str = "no connection") -> EngineUnavailable:
    """No answer from `where`: a timeout, or a connection that failed (`lost` when httpx says nothing)."""
    if isinstance(e, httpx.TimeoutException):
        return EngineUnavailable(f"{where}: timed out ({type(e).__name__}: {e})")
    return EngineUnavailable(f"{where}: {type(e).__name__}: {e or lost}")

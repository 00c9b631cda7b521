"""`SGLangClient`: the controller's HTTP handle on ONE SGLang-API server (real SGLang or the embedded engine).

It speaks SGLang's native endpoints and field names (`sglang/srt/entrypoints/http_server.py`, `io_struct.py`,
`sglang/api/v1/api_types.py`) and turns every answer into a validated `GenerateOutput` or an `EngineError`,
never a half-built output: HTTP 5xx, refused/reset connections and timeouts raise `EngineUnavailable` (a
router may retry elsewhere); HTTP 4xx, invalid JSON, missing fields, wrong types and inconsistent lengths
raise `EngineBadResponse` (the answer breaks the contract; retrying would hide a bug). Policy versions are
ints here and decimal strings on the wire (the server's `"default"` is None). Weight calls always send
`abort_all_requests: false`: SGLang's `/update_weight_version` defaults it to true and silently kills
in-flight generation (radixark/miles PR #2296).

Partial rollout (`partial_rollout=True`): a `/generate` aborted because this handle paused the server in
`abort` mode keeps its tokens; the call waits until `continue_generation()` has been called on this handle
(an `asyncio.Event`) and resubmits `input_ids + produced`, `max_new_tokens` reduced by what was produced,
to the same server. The pieces join into one `GenerateOutput` with the producing version of every token.

Batching (`batch_generate=True`, the run's `--engine-batch-generate`): `/generate` calls with the same
routing key (a prompt group's samples) made in the same event-loop tick go to the server as ONE batch
`/generate` (SGLang's list-valued `input_ids`/`rid`/`sampling_params`), one HTTP round trip instead of n:
on the 2-core quickstart that round trip was the largest cost of the controller and of the engine's
event loop. The first call of a tick leads: it waits one tick for the others, sends, and hands each its
own answer. Each call keeps its own outcome: an item's malformed answer fails that item only, a batch
the server refuses with a 4xx is resent item by item (one bad prompt must not fail its siblings), and if
the leader is cancelled the others send on their own. A batch answers when its last item finishes, which
costs a single-turn group nothing (the group waits for its slowest sample anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import uuid
from collections.abc import Awaitable, Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, final

import aiohttp
import httpx
import structlog

from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable
from miles_aio.inference.base import ChunkSink, PauseMode, SingleServerBroadcast
from miles_aio.inference.wire import (
    ROUTING_KEY_HEADER,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    StreamDecoder,
    decode_generate_response,
    decode_json_object,
    decode_json_value,
    encode_json,
    error_text,
    http_error,
    join_pieces,
    parse_generate_response,
    parse_wire_version,
    transport_error,
    wire_version,
)
from miles_aio.types import GenerateOutput

__all__ = [
    "AiohttpTransport",
    "BodyStream",
    "ClientTimeouts",
    "FlushRefused",
    "SGLangClient",
    "open_body_stream",
    "read_all",
]

_log = structlog.get_logger(__name__)

KEEPALIVE_EXPIRY_S: Final = 4.0
"""Idle connections close before SGLang's uvicorn keep-alive (5 s) would close them under a request."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientTimeouts:
    """Deadlines in seconds for one HTTP exchange."""

    connect_s: float = 5.0
    """TCP connect and connection-pool wait, for every call."""
    generate_s: float | None = 600.0
    """The whole `/generate` call, from connecting to the last byte of the answer; None: no limit."""
    admin_s: float = 600.0
    """Pause/continue/flush/weight-update calls (loading weights from disk can take minutes)."""
    health_s: float = 30.0
    """`/health_generate`, `/model_info`, `/server_info`, `/abort_request`."""

    def __post_init__(self) -> None:
        given = {
            "connect_s": self.connect_s,
            "admin_s": self.admin_s,
            "health_s": self.health_s,
            "generate_s": 1.0 if self.generate_s is None else self.generate_s,
        }
        if bad := {k: v for k, v in given.items() if not v > 0}:
            raise ValueError(f"ClientTimeouts must be > 0, got {bad}")


class FlushRefused(EngineBadResponse):
    """`/flush_cache` answered 400: the server refuses to flush while requests are running or queued.
    Usually transient (requests still draining after a pause), so the router retries it, bounded."""


@dataclass(slots=True)
class _Item:
    """One call's share of a (possibly batched) `/generate`."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]


@dataclass(slots=True)
class _Batch:
    """The calls gathered in one tick under one routing key: the leader's item first, then each
    follower's item with the future its answer (or error) is delivered to."""

    items: list[_Item]
    waiters: list[asyncio.Future[GenerateOutput]]


class _SendAlone(Exception):
    """Internal: this call's batch could not answer it (the server refused the batch with a 4xx, or the
    leader was cancelled): send the item by itself."""


class _State(enum.Enum):
    OPEN = "open"  # usable
    CLOSED = "closed"  # aclose() was called: every call raises EngineUnavailable


@contextlib.contextmanager
def _as_httpx_errors() -> Iterator[None]:
    """aiohttp's errors as the matching httpx.TransportError (what `SGLangClient._send` maps)."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as e:
        raise httpx.ConnectTimeout(str(e) or "connect timed out") from e
    except TimeoutError as e:  # aiohttp's SocketTimeoutError, or a plain asyncio timeout
        raise httpx.ReadTimeout(str(e) or "read timed out") from e
    except aiohttp.ClientConnectorError as e:
        raise httpx.ConnectError(str(e)) from e
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
        raise httpx.RemoteProtocolError(str(e) or type(e).__name__) from e
    except aiohttp.ClientError as e:
        raise httpx.ReadError(f"{type(e).__name__}: {e}") from e


def _aiohttp_timeout(deadlines_s: Mapping[str, float | None]) -> aiohttp.ClientTimeout:
    """httpx's timeout-extension keys (connect, pool, read) and `total` as aiohttp's timeout."""
    return aiohttp.ClientTimeout(
        total=deadlines_s.get("total"),
        connect=deadlines_s.get("pool"),
        sock_connect=deadlines_s.get("connect"),
        sock_read=deadlines_s.get("read"),
    )


class BodyStream:
    """An answer being read as it arrives (`AiohttpTransport.open_stream`, or any httpx transport's
    response): `status`, then `read()` piece by piece (b"" at the end), then `aclose()`. Transport errors
    come out of `read` as httpx.TransportError, like `exchange`'s."""

    def __init__(
        self,
        status: int,
        read: Callable[[], Awaitable[bytes]],
        close: Callable[[], Awaitable[None]],
    ) -> None:
        self.status = status
        self._read = read
        self._close = close

    async def read(self) -> bytes:
        return await self._read()

    async def aclose(self) -> None:
        """Release the connection: closed, unless the answer was read to its end (the server sees a
        client that left, and aborts the request)."""
        await self._close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport over one aiohttp `ClientSession`, reading each answer whole (no streaming).

    httpx's own pool slows down sharply with many concurrent requests (encode/httpx#3215); aiohttp's
    does not (`benchmarks.client` measures both). `exchange` is the same round trip without building
    httpx Request/Response objects (~40 µs per call): `SGLangClient` uses it for `/generate`.
    The session is made on first use (it needs a running loop).
    """

    def __init__(self, *, max_connections: int = 2048, keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S):
        self._limit = max_connections
        self._keepalive_s = keepalive_expiry_s
        self._session: aiohttp.ClientSession | None = None

    async def exchange(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None,
        deadlines_s: Mapping[str, float | None],
        headers: Mapping[str, str] | list[tuple[str, str]],
    ) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
        """One round trip: (status, raw headers, body). `deadlines_s` has httpx's timeout-extension keys
        (connect, pool, read) and optionally `total`, one timer for the whole call (cheaper than a read
        timer re-armed on every chunk). aiohttp errors come out as the matching httpx.TransportError."""
        session = self._client_session()
        t = _aiohttp_timeout(deadlines_s)
        with _as_httpx_errors():
            async with session.request(
                method, url, data=content, headers=headers, timeout=t, allow_redirects=False
            ) as resp:
                return resp.status, resp.raw_headers, await resp.read()

    async def open_stream(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None,
        deadlines_s: Mapping[str, float | None],
        headers: Mapping[str, str] | list[tuple[str, str]],
    ) -> BodyStream:
        """`exchange`, with the body read as it arrives: the `BodyStream` once the status line and headers
        are in. The `total` deadline covers reading the body too."""
        session = self._client_session()
        t = _aiohttp_timeout(deadlines_s)
        with _as_httpx_errors():
            resp = await session.request(
                method, url, data=content, headers=headers, timeout=t, allow_redirects=False
            )

        async def read() -> bytes:
            with _as_httpx_errors():
                return await resp.content.readany()

        async def close() -> None:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()

        return BodyStream(resp.status, read, close)

    def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=self._keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        status, headers, body = await self.exchange(
            request.method,
            str(request.url),
            content=await request.aread() or None,
            headers=request.headers.multi_items(),
            deadlines_s=request.extensions.get("timeout", {}),
        )
        return httpx.Response(status, headers=headers, content=body, request=request)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


@final
class SGLangClient:
    """Async client for one SGLang-API server; implements `miles_aio.inference.base.InferenceEngine`.

    Use `async with SGLangClient(url) as client:` or call `aclose()`; calls on a closed client raise
    `EngineUnavailable`. `transport` swaps the HTTP transport (default `AiohttpTransport`). Control calls go
    through an `httpx.AsyncClient`; `/generate`, the hot path, goes straight to the transport, skipping the
    client's per-request URL/header/cookie/auth merging (~250 µs a request; `benchmarks.client`).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeouts: ClientTimeouts = ClientTimeouts(),
        partial_rollout: bool = False,
        batch_generate: bool = False,
        max_connections: int = 2048,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url: Final = url.rstrip("/")
        self.partial_rollout: Final = partial_rollout
        self.batch_generate: Final = batch_generate
        self._open_batches: dict[Hashable, _Batch] = {}
        """Per routing key, the batch gathering calls during the current tick (its leader is waiting)."""
        self.batched_requests = 0
        """How many `/generate` round trips carried more than one call."""
        self._timeouts = timeouts
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport or AiohttpTransport(max_connections=max_connections)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=self._auth,
            transport=self._transport,
            trust_env=False,  # loopback and cluster URLs must never go through an HTTP(S)_PROXY
        )
        self._generate_url = f"{self.url}/generate"
        self._gen_headers = {"Content-Type": "application/json", **self._auth}
        self._rid_prefix = uuid.uuid4().hex  # rids must be unique across every client of a server
        self._rid_counter = itertools.count()
        c, g = timeouts.connect_s, timeouts.generate_s
        self._gen_deadlines = {"connect": c, "total": g}  # AiohttpTransport.exchange: one timer per call
        self._gen_httpx_timeout = {"connect": c, "pool": c, "read": g, "write": g}  # any other transport
        self._state = _State.OPEN
        self._pause_epoch = 0
        """Bumped by every pause in abort mode before it is sent: an abort racing the pause still counts."""
        self._abort_paused = False
        """True from a pause in abort mode until the next continue_generation."""
        self._resumed = asyncio.Event()
        """Partial-rollout continuations wait on it: cleared by a pause, set by continue and by aclose."""
        self._resumed.set()
        self.continuations = 0
        """How many partial-rollout continuations this client has resubmitted."""

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool and wake partial-rollout waiters (they raise EngineUnavailable)."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self._resumed.set()
        await self._http.aclose()  # closes the transport too

    # ---- HTTP plumbing -------------------------------------------------------------------------------

    async def _send(self, path: str, exchange: Awaitable[tuple[int, bytes]]) -> bytes:
        """Await one HTTP exchange; map transport failures and non-2xx statuses onto EngineError."""
        try:
            status, body = await exchange
        except httpx.TransportError as e:
            raise transport_error(f"{self.url}{path}", e) from e
        if status >= 400:
            raise http_error(f"{self.url}{path}", status, body)
        return body

    async def _request(
        self, method: str, path: str, *, timeout_s: float, body: Mapping[str, Any] | None = None
    ) -> bytes:
        """One control-plane call through the httpx.AsyncClient; returns the answer's body."""
        self._check_open()
        timeout = httpx.Timeout(timeout_s, connect=self._timeouts.connect_s, pool=self._timeouts.connect_s)

        async def exchange() -> tuple[int, bytes]:
            resp = await self._http.request(method, path, json=body, timeout=timeout)
            return resp.status_code, resp.content

        return await self._send(path, exchange())

    async def _post_json(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST an admin call (None values left out); return its JSON answer, raise if `success` is false."""
        body = {k: v for k, v in body.items() if v is not None}
        answer = await self._request("POST", path, body=body, timeout_s=self._timeouts.admin_s)
        data = decode_json_object(answer, f"{self.url}{path}")
        if data.get("success") is False:
            raise EngineError(f"{self.url}{path}: server refused: {data.get('message')!r}")
        return data

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise EngineUnavailable(f"{self.url}: client is closed")

    # ---- /generate -----------------------------------------------------------------------------------

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        """One generation: one `/generate`, or several when partial rollout continues a pause-abort.

        A continuation waits on this handle's resume event; `continue_generation()` or `aclose()` sets it.
        `routing_key` travels as the `X-SMG-Routing-Key` header, for an sglang-router in front.
        """
        return await self._continued(
            input_ids, sampling_params, lambda ids, params: self._generate_once(ids, params, routing_key)
        )

    async def _continued(
        self,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        once: Callable[[list[int], Mapping[str, Any]], Awaitable[tuple[GenerateOutput, bool]]],
    ) -> GenerateOutput:
        """`once(input_ids, sampling_params)`, then, with partial rollout, its continuations after a pause
        in abort mode (see the module docstring), joined into one output."""
        if sampling_params.get("n", 1) != 1:
            raise ValueError(f"sampling_params n must be 1, got {sampling_params['n']!r}")
        out, paused_meanwhile = await once(input_ids, sampling_params)
        if not self.partial_rollout:
            return out
        max_new = int(sampling_params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS))
        pieces = [out]
        produced: list[int] = list(out.output_ids)
        while out.finish_reason == "abort" and paused_meanwhile and len(produced) < max_new:
            _log.debug("partial_rollout_wait", url=self.url, produced=len(produced))
            await self._resumed.wait()
            self._check_open()
            self.continuations += 1
            params = {**sampling_params, "max_new_tokens": max_new - len(produced)}
            if isinstance(min_new := params.get("min_new_tokens"), int) and min_new > 0:
                params["min_new_tokens"] = max(0, min_new - len(produced))
            out, paused_meanwhile = await once(input_ids + produced, params)
            pieces.append(out)
            produced.extend(out.output_ids)
        return out if len(pieces) == 1 else join_pieces(pieces, max_new_tokens=max_new)

    async def _generate_once(
        self, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None
    ) -> tuple[GenerateOutput, bool]:
        """One `/generate` (alone, or one item of a batch); also says whether a pause in abort mode
        started while it was in flight."""
        self._check_open()
        item = _Item(f"{self._rid_prefix}-{next(self._rid_counter)}", input_ids, dict(sampling_params))
        epoch = self._pause_epoch
        if self.batch_generate and routing_key is not None:
            out = await self._batched(item, routing_key)
        else:
            out = await self._post_one(item, routing_key)
        if type(max_new := sampling_params.get("max_new_tokens")) is int and len(out.output_ids) > max_new:
            where = f"{self.url}/generate rid={item.rid}"
            raise EngineBadResponse(f"{where}: {len(out.output_ids)} tokens for max_new_tokens={max_new}")
        return out, self._abort_paused or self._pause_epoch != epoch

    async def _batched(self, item: _Item, key: Hashable) -> GenerateOutput:
        """Join the batch gathering under `key` this tick, or lead one: wait a tick, send them all.

        Waits for: (a follower) the leader's delivery; (the leader) one loop tick, then the answer."""
        if (batch := self._open_batches.get(key)) is not None:
            waiter: asyncio.Future[GenerateOutput] = asyncio.get_running_loop().create_future()
            batch.items.append(item)
            batch.waiters.append(waiter)
            try:
                return await waiter
            except _SendAlone:
                return await self._post_one(item, key)
        batch = self._open_batches[key] = _Batch([item], [])
        try:
            try:
                await asyncio.sleep(0)  # the rest of the group reaches here in this same tick
            finally:
                if self._open_batches.get(key) is batch:
                    del self._open_batches[key]
            if not batch.waiters:
                return await self._post_one(item, key)
            self.batched_requests += 1
            outs = await self._post_batch(batch.items, key)
        except _SendAlone:
            _deliver(batch.waiters, _SendAlone())
            return await self._post_one(item, key)
        except BaseException as e:
            # cancelled (or a bug): the others send on their own; an engine error is everyone's
            _deliver(batch.waiters, e)
            raise
        for waiter, out in zip(batch.waiters, outs[1:], strict=True):
            if not waiter.done():  # a cancelled follower's answer is dropped
                if isinstance(out, EngineError):
                    waiter.set_exception(out)
                else:
                    waiter.set_result(out)
        if isinstance(outs[0], EngineError):
            raise outs[0]
        return outs[0]

    async def _post_one(self, item: _Item, routing_key: Hashable | None) -> GenerateOutput:
        """One `/generate` for one item."""
        out = (await self._post_batch([item], routing_key))[0]
        if isinstance(out, EngineError):
            raise out
        return out

    async def _post_batch(
        self, items: list[_Item], routing_key: Hashable | None
    ) -> list[GenerateOutput | EngineError]:
        """One `/generate` carrying `items` (a plain request for one, SGLang's batch form for several):
        each item's answer, or the EngineBadResponse its part of the answer earned. Raises what fails
        them all (EngineError); `_SendAlone` if the server refused a batch with a 4xx."""
        one = len(items) == 1
        body = {
            "rid": items[0].rid if one else [i.rid for i in items],
            "input_ids": items[0].input_ids if one else [i.input_ids for i in items],
            "sampling_params": items[0].sampling_params if one else [i.sampling_params for i in items],
            "return_logprob": True,
            "stream": False,
        }
        headers = self._gen_headers
        if routing_key is not None:
            headers = {**headers, ROUTING_KEY_HEADER: str(routing_key)}
        exchange = self._post_generate(encode_json(body), headers)
        try:
            answer = await self._send("/generate", exchange if one else _send_alone_on_4xx(exchange))
        except EngineUnavailable as e:
            if isinstance(e.__cause__, httpx.TimeoutException):  # the server may still be generating: stop it
                async with asyncio.TaskGroup() as tg:
                    for i in items:
                        tg.create_task(self._abort_after_timeout(i.rid), name=f"abort-{i.rid}")
            raise
        if one:
            where = f"{self.url}/generate rid={items[0].rid}"
            return [decode_generate_response(answer, where=where)]
        where = f"{self.url}/generate (batch of {len(items)})"
        data = decode_json_value(answer, where)
        if type(data) is not list or len(data) != len(items):
            got = f"a list of {len(data)}" if type(data) is list else type(data).__name__
            raise EngineBadResponse(f"{where}: expected a list of {len(items)} answers, got {got}")
        outs: list[GenerateOutput | EngineError] = []
        for i, answer_item in zip(items, data, strict=True):
            try:
                outs.append(parse_generate_response(answer_item, where=f"{self.url}/generate rid={i.rid}"))
            except EngineBadResponse as e:
                outs.append(e)
        return outs

    async def _abort_after_timeout(self, rid: str) -> None:
        try:
            await self.abort_request(rid=rid)
        except EngineError as e:
            _log.warning("abort_after_timeout_failed", url=self.url, rid=rid, error=str(e))

    async def _post_generate(self, content: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """The hot path: straight into aiohttp when that is the transport, else one httpx.Request."""
        if isinstance(self._transport, AiohttpTransport):
            status, _, body = await self._transport.exchange(
                "POST", self._generate_url, content=content, headers=headers, deadlines_s=self._gen_deadlines
            )
            return status, body
        request = httpx.Request(
            "POST",
            self._generate_url,
            headers=headers,
            content=content,
            extensions={"timeout": self._gen_httpx_timeout},
        )
        resp = await self._transport.handle_async_request(request)
        try:
            return resp.status_code, await resp.aread()
        finally:
            await resp.aclose()

    # ---- /generate, streamed -------------------------------------------------------------------------

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        """`generate` over SGLang's streaming `/generate` (`stream: true`: SSE `data:` chunks, cumulative),
        awaiting `on_chunk` with the new tokens of every chunk (`base.StreamingEngine`). The result is the
        last chunk parsed as a whole answer, so it is what `generate` returns for the same generation;
        partial-rollout continuation streams on, and its pieces join as in `generate`."""
        return await self._continued(
            input_ids,
            sampling_params,
            lambda ids, params: self._stream_once(ids, params, routing_key, on_chunk),
        )

    async def _stream_once(
        self,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        routing_key: Hashable | None,
        on_chunk: ChunkSink,
    ) -> tuple[GenerateOutput, bool]:
        """One streaming `/generate` (see `_generate_once`)."""
        self._check_open()
        rid = f"{self._rid_prefix}-{next(self._rid_counter)}"
        body = {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
            "stream": True,
        }
        headers = self._gen_headers
        if routing_key is not None:
            headers = {**headers, ROUTING_KEY_HEADER: str(routing_key)}
        epoch = self._pause_epoch
        where = f"{self.url}/generate rid={rid} (stream)"
        try:
            out = await self._send_stream(encode_json(body), headers, where, on_chunk)
        except EngineUnavailable as e:
            if isinstance(e.__cause__, httpx.TimeoutException):  # the server may still be generating: stop it
                try:
                    await self.abort_request(rid=rid)
                except EngineError as abort_error:
                    _log.warning("abort_after_timeout_failed", url=self.url, rid=rid, error=str(abort_error))
            raise
        if type(max_new := sampling_params.get("max_new_tokens")) is int and len(out.output_ids) > max_new:
            raise EngineBadResponse(f"{where}: {len(out.output_ids)} tokens for max_new_tokens={max_new}")
        return out, self._abort_paused or self._pause_epoch != epoch

    async def _send_stream(
        self, content: bytes, headers: dict[str, str], where: str, on_chunk: ChunkSink
    ) -> GenerateOutput:
        """POST, then read SSE events until the chunk with a finish reason; every chunk's new tokens go to
        `on_chunk` as they arrive. Transport failures and error events map as in `_send`; a stream that
        ends before its last chunk is `EngineUnavailable` (the server went away mid-generation)."""
        try:
            stream = await self._open_stream(content, headers)
        except httpx.TransportError as e:
            raise transport_error(where, e) from e
        try:
            if stream.status >= 400:
                raise http_error(where, stream.status, await read_all(stream))
            decoder, buffer = StreamDecoder(where), b""
            while True:
                try:
                    piece = await stream.read()
                except httpx.TransportError as e:
                    raise transport_error(where, e, lost="connection lost") from e
                if not piece:
                    raise EngineUnavailable(f"{where}: the stream ended before the generation finished")
                buffer += piece
                *events, buffer = buffer.split(b"\n\n")
                datas = [d for d in map(_sse_data, events) if d is not None]
                for k, data in enumerate(datas):
                    if data == b"[DONE]":
                        raise EngineBadResponse(f"{where}: [DONE] before a chunk with a finish reason")
                    if k + 1 < len(datas) and datas[k + 1] != b"[DONE]":
                        continue  # cumulative: a later chunk that arrived with it covers its tokens
                    chunk, out = decoder.feed(data)
                    if chunk.output_ids:
                        await on_chunk(chunk)
                    if out is not None:
                        return out
        finally:
            await stream.aclose()

    async def _open_stream(self, content: bytes, headers: dict[str, str]) -> BodyStream:
        return await open_body_stream(
            self._transport,
            self._generate_url,
            content=content,
            headers=headers,
            deadlines_s=self._gen_deadlines,
            httpx_timeout=self._gen_httpx_timeout,
        )

    # ---- control plane -------------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode) -> None:
        """`/pause_generation`. `abort`: in-flight requests come back aborted (and, with partial rollout,
        wait for `continue_generation`); `retract`/`in_place`: they stay on the server."""
        self._resumed.clear()
        if mode == "abort":
            self._abort_paused = True
            self._pause_epoch += 1
        await self._post_json("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """`/continue_generation`, then release the partial-rollout continuations waiting on this handle."""
        await self._post_json("/continue_generation", {})
        self._abort_paused = False
        self._resumed.set()

    async def flush_cache(self) -> None:
        """`/flush_cache`. SGLang answers 400 while requests are running or waiting in its queue (aborted
        ones still draining after a pause, say): `FlushRefused`, which the router asks again
        (`RouterPolicy.flush_attempts`). Any other error status maps as for every call."""
        self._check_open()
        t = self._timeouts
        timeout = httpx.Timeout(t.admin_s, connect=t.connect_s, pool=t.connect_s)

        async def exchange() -> tuple[int, bytes]:
            resp = await self._http.request("POST", "/flush_cache", timeout=timeout)
            if resp.status_code == 400:
                raise FlushRefused(f"{self.url}/flush_cache: HTTP 400: {error_text(resp.content)}")
            return resp.status_code, resp.content

        await self._send("/flush_cache", exchange())

    async def update_weight_version(self, version: int) -> None:
        """Stamp `version` without aborting in-flight requests (`abort_all_requests: false`)."""
        body = {"new_version": wire_version(version), "abort_all_requests": False}
        data = await self._post_json("/update_weight_version", body)
        if data.get("new_version", body["new_version"]) != body["new_version"]:
            raise EngineBadResponse(f"{self.url}/update_weight_version: answered {data!r} to {body!r}")

    async def update_weights_from_disk(
        self, model_path: str, *, version: int, flush_cache: bool = True, load_format: str | None = None
    ) -> None:
        """`/update_weights_from_disk`, stamping the new policy version in the same call."""
        body = {
            "model_path": model_path,
            "weight_version": wire_version(version),
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "load_format": load_format,
        }
        await self._post_json("/update_weights_from_disk", body)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """`/init_weights_update_group`: join the trainer's torch.distributed group for broadcasts."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._post_json("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
        last_bucket: bool = True,
    ) -> None:
        """`/update_weights_from_distributed`: receive these tensors by broadcast from trainer rank 0.
        Each bucket is applied on its own (`last_bucket` changes nothing here)."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "load_format": load_format,
            "weight_version": None if version is None else wire_version(version),
        }
        await self._post_json("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """`/destroy_weights_update_group`: leave a broadcast group (one formed for an older membership)."""
        await self._post_json("/destroy_weights_update_group", {"group_name": group_name})

    def weight_broadcast(self) -> SingleServerBroadcast:
        """This server alone takes a weight push by broadcast (the three calls above)."""
        return SingleServerBroadcast(self)

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        """`/abort_request` for one rid, or for every request with `abort_all`."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        body = {"rid": rid, "abort_all": abort_all}
        await self._request("POST", "/abort_request", body=body, timeout_s=self._timeouts.health_s)

    async def health_generate(self) -> None:
        """`/health_generate` (SGLang generates one token); raises EngineError unless it answers 200."""
        await self._request("GET", "/health_generate", timeout_s=self._timeouts.health_s)

    async def model_info(self) -> dict[str, Any]:
        """`/model_info` (model_path, weight_version, ...)."""
        return decode_json_object(
            await self._request("GET", "/model_info", timeout_s=self._timeouts.health_s),
            f"{self.url}/model_info",
        )

    async def server_info(self) -> dict[str, Any]:
        """`/server_info` (server args, internal_states, version, ...)."""
        return decode_json_object(
            await self._request("GET", "/server_info", timeout_s=self._timeouts.health_s),
            f"{self.url}/server_info",
        )

    async def weight_version(self) -> int | None:
        """The server's current policy version: `/model_info`'s `weight_version` (SGLang's API now), or
        `/get_weight_version` where `/model_info` has none (older SGLang releases; miles reads both)."""
        info, where = await self.model_info(), f"{self.url}/model_info"
        if "weight_version" not in info:
            where = f"{self.url}/get_weight_version"
            answer = await self._request("GET", "/get_weight_version", timeout_s=self._timeouts.health_s)
            info = decode_json_object(answer, where)
        return parse_wire_version(info.get("weight_version"), where)


async def open_body_stream(
    transport: httpx.AsyncBaseTransport,
    url: str,
    *,
    content: bytes,
    headers: Mapping[str, str],
    deadlines_s: Mapping[str, float | None],
    httpx_timeout: Mapping[str, float | None],
) -> BodyStream:
    """POST `content` to `url`; the answer's body is read as it arrives: `AiohttpTransport.open_stream`
    (`deadlines_s`), or any other httpx transport's response stream (`httpx_timeout`: the tests' fakes)."""
    if isinstance(transport, AiohttpTransport):
        return await transport.open_stream(
            "POST", url, content=content, headers=headers, deadlines_s=deadlines_s
        )
    request = httpx.Request(
        "POST", url, headers=headers, content=content, extensions={"timeout": httpx_timeout}
    )
    resp = await transport.handle_async_request(request)
    pieces = resp.aiter_bytes()  # not aiter_raw: a fake's bytes body counts as already consumed

    async def read() -> bytes:
        return await anext(pieces, b"")

    return BodyStream(resp.status_code, read, resp.aclose)


async def read_all(stream: BodyStream) -> bytes:
    body = b""
    while piece := await stream.read():
        body += piece
    return body


def _sse_data(event: bytes) -> bytes | None:
    """The data of one SSE event (its `data:` lines joined), or None for a comment or keep-alive."""
    if event.startswith(b"data: ") and event.find(b"\n") < 0:  # SGLang's: one line of JSON
        return event[6:].strip()
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _deliver(waiters: list[asyncio.Future[GenerateOutput]], error: BaseException) -> None:
    """Fail every follower still waiting: with a copy of `error` if it is an EngineError (one instance
    each: raised in several tasks, a shared exception would collect all their tracebacks), else (the
    leader cancelled, or a bug) with `_SendAlone`."""
    for w in waiters:
        if not w.done():
            w.set_exception(_copy_error(error) if isinstance(error, EngineError) else _SendAlone())


async def _send_alone_on_4xx(exchange: Awaitable[tuple[int, bytes]]) -> tuple[int, bytes]:
    """A batch's exchange: a 4xx refuses the batch, not necessarily each item (`_SendAlone`)."""
    status, body = await exchange
    if 400 <= status < 500:
        raise _SendAlone
    return status, body


def _copy_error(error: EngineError) -> EngineError:
    """A fresh exception of `error`'s type and message, with its cause (what the router inspects)."""
    copy = type(error)(str(error))
    copy.__cause__ = error.__cause__
    return copy

"""`VLLMClient`: the controller's HTTP handle on ONE vLLM server, behind the same engine protocol as
`SGLangClient` (`router.EngineClient`), so the router, controller, buffer, scheduler and eval use it
unchanged (`--rollout-backend vllm`, `--vllm-urls`).

It speaks vLLM's own routes (read from vLLM 0.32's source; the RL and dev routes exist only on a server
started with `VLLM_SERVER_DEV_MODE=1`):

  generate            POST /v1/completions, `prompt` as token ids, `logprobs: 0`, `return_token_ids`
                      (`stream: true` for `generate_stream`: SSE chunks of new token ids and logprobs)
  pause / continue    POST /pause?mode=abort|keep&clear_cache=false, POST /resume
  abort               POST /abort_requests {"request_ids": [...]} (vLLM's ids: `cmpl-<request_id>-0`)
  flush               POST /reset_prefix_cache (answers {"success": false} while blocks are held)
  weights from disk   POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": dir}}
  weights by NCCL     POST /init_weight_transfer_engine, /start_weight_update, /update_weights,
                      /finish_weight_update, /shutdown_weight_transfer_engine (below)
  version             POST /update_weight_version {"new_version"}, GET /weight_info
  health / info       GET /health, a 1-token completion, GET /server_info, GET /version

**Per-token versions, without engine help.** The completions API stamps no weight version on tokens, so
this client derives them, exactly by construction: a request is sent as *pieces*, and no piece ever
spans a weight update. Each piece is stamped with the version this client last set
(`update_weight_version`) when it was sent. A piece never starts while the server is paused (it waits
for `continue_generation`), and `continue_generation` first ends every piece started before the pause:
it asks vLLM to abort them (the answer keeps every token made so far, `finish_reason: "abort"`) and
waits until each has answered, and only then resumes the server. So every token of a piece came from
the weights the piece was stamped with; a request split at a pause is continued as a new piece,
`prompt + produced` with the remaining budget, and the pieces join into one `GenerateOutput`
(`wire.join_pieces`).

**Pause modes** (miles → vLLM):

  abort     `/pause?mode=abort`: vLLM aborts every request; they come back with their tokens. With
            partial rollout they are continued after `continue_generation` (as `SGLangClient`).
  retract   `/pause?mode=keep` (requests frozen in the scheduler, nothing thrown away while the
  in_place  weights load), split at the resume and continued as above. `flush_cache` while paused
            preempts the frozen requests (`reset_running_requests=true`), as SGLang's retract does.
            Where they differ from SGLang: a continued request is a new vLLM request, recomputed from
            its prefix (from vLLM's prefix cache unless it was flushed). in_place therefore does not
            keep a request on its pre-update KV unless the prefix cache still holds it, and that cache
            would then serve stale KV to new requests too, exactly miles #2782: run in_place with
            `--no-enable-prefix-caching` (`server_info()` reports it as `disable_radix_cache`, which
            `engines` checks), and it behaves like retract.

**Weights by broadcast** (GPU only: vLLM's weight transfer is NCCL, it has no gloo backend) go through
vLLM's native weight-transfer routes, on a server started with `--weight-transfer-config
'{"backend": "nccl"}'`: `/init_weight_transfer_engine {"init_info": {master_address, master_port,
rank_offset, world_size, packed: false}}` while trainer rank 0 opens its end of the group
(`trainer.vllm_transfer`: a StatelessProcessGroup and a PyNccl communicator, so the trainer's
interpreter needs vllm too); then one update per push: `/start_weight_update`, per bucket
`/update_weights {"update_info": {names, dtype_names, shapes}}` while rank 0 broadcasts each tensor in
`names` order, and after the last `/finish_weight_update`; `/shutdown_weight_transfer_engine` leaves the
group (also asked before a new join by a server still in an old one). The transfer routes are never
retried after a cut connection, and an update that paused the server itself resumes it only once it
succeeded. This path has not been run here (no GPU on the development machine): `tests/gpu` holds its
test.

Errors map as in `SGLangClient`: HTTP 5xx, refused/reset connections and timeouts raise
`EngineUnavailable`; 4xx, invalid JSON and answers that break the contract raise `EngineBadResponse`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import re
import uuid
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Final, final

import httpx
import structlog

from miles_aio._notify import Notifier
from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable
from miles_aio.inference.base import ChunkSink, GenerateChunk, PauseMode, SingleServerBroadcast
from miles_aio.inference.client import (
    AiohttpTransport,
    BodyStream,
    ClientTimeouts,
    FlushRefused,
    open_body_stream,
    read_all,
)
from miles_aio.inference.wire import (
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    decode_json_object,
    encode_json,
    http_error,
    join_pieces,
    parse_wire_version,
    transport_error,
    wire_version,
)
from miles_aio.types import FinishReason, GenerateOutput

__all__ = ["VLLM_DEV_MODE_ENV", "VLLMClient", "completion_params"]

_log = structlog.get_logger(__name__)

VLLM_DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"
"""vLLM serves its RL routes (/pause, /resume, /abort_requests, /collective_rpc, ...) only with this =1."""
ABORT_RECHECK_S: Final = 0.25
"""While splitting at a resume: how long to wait for the aborted pieces before asking vLLM again. A
piece whose HTTP request had not reached the server yet is unknown there when the abort arrives, so it
is aborted again (the one deliberate re-ask; every call is bounded by the router's admin deadline)."""

# SGLang sampling-param name → vLLM completions field. Anything else is refused (ValueError): a param
# vLLM would not read the same way must not pass silently.
_SAMPLING: Final[dict[str, str]] = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}
_FINISH: Final[dict[object, FinishReason]] = {"stop": "stop", "length": "length", "abort": "abort"}


def completion_params(sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang-style sampling params as vLLM `/v1/completions` fields (`max_tokens` always set: vLLM's
    default is 16, SGLang's 128). Raises ValueError for `n != 1` or a param vLLM has no match for."""
    if sampling_params.get("n", 1) != 1:
        raise ValueError(f"sampling_params n must be 1, got {sampling_params['n']!r}")
    if unknown := sorted(set(sampling_params) - set(_SAMPLING) - {"n"}):
        raise ValueError(f"sampling params {unknown} have no vLLM completions equivalent")
    out = {_SAMPLING[k]: v for k, v in sampling_params.items() if k != "n" and v is not None}
    out.setdefault("max_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    return out


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(eq=False, slots=True)
class _Piece:
    """One `/v1/completions` request in flight: part of a generation, all of it from one weight version."""

    request_id: str
    """vLLM's id of the request (`cmpl-<our request_id>-0`), what `/abort_requests` takes."""
    epoch: int
    """The client's pause count when it was sent: a piece from before the last pause is stale."""
    split_by: PauseMode | None = None
    """The pause that came while it was in flight (it is then ended before the resume)."""


@final
class VLLMClient:
    """Async client for one vLLM server (started with `VLLM_SERVER_DEV_MODE=1`); implements
    `router.EngineClient` and `base.InferenceEngine`. See the module docstring for how versions, pauses
    and weights map. Use `async with VLLMClient(url) as client:` or call `aclose()`."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeouts: ClientTimeouts | None = None,
        partial_rollout: bool = False,
        max_connections: int = 2048,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url: Final = url.rstrip("/")
        self.partial_rollout: Final = partial_rollout
        self._timeouts = timeouts or ClientTimeouts()
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport or AiohttpTransport(
            max_connections=max_connections, keepalive_expiry_s=2.0
        )
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=self._auth,
            transport=self._transport,
            trust_env=False,  # loopback and cluster URLs must never go through an HTTP(S)_PROXY
        )
        self._rid_prefix = uuid.uuid4().hex
        self._rid_counter = itertools.count()
        self._state = _State.OPEN
        self._version: int | None = None
        self._version_known = False
        """False until the server's version was read (`/weight_info`) or stamped by this client."""
        self._epoch = 0
        """Pauses so far (bumped before /pause is sent)."""
        self._paused: PauseMode | None = None
        self._resumed = asyncio.Event()
        """Pieces wait on it before they are sent: cleared by a pause, set by continue and aclose."""
        self._resumed.set()
        self._pieces: dict[str, _Piece] = {}
        self._changed = Notifier()
        """Notified whenever a piece ends (continue_generation waits for the stale ones)."""
        self.continuations = 0
        """How many pieces this client sent to continue a generation split at a pause."""
        self._own_pause = False
        """The current pause is this client's own: a weight update that came outside a pause made it. The
        update resumes it once it succeeded; a failed one leaves the engine paused for whoever handles the
        failure (the router excludes the engine; its probe's `continue_generation` resumes it), so no
        token from half-loaded weights goes out stamped with the old version."""
        self._transfer_open = False
        """A weight update by broadcast is in progress on the server (its first bucket came, its last
        not yet, or finishing it failed)."""
        self._in_group = False
        """The server was asked to join a trainer's NCCL group and has not been asked to leave it."""

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool; generations waiting for a resume raise EngineUnavailable."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self._resumed.set()
        await self._http.aclose()

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise EngineUnavailable(f"{self.url}: client is closed")

    # ---- HTTP plumbing -------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        retry_dropped: bool = True,
    ) -> bytes:
        """One HTTP exchange; transport failures and non-2xx statuses as EngineError."""
        self._check_open()
        t = httpx.Timeout(timeout_s, connect=self._timeouts.connect_s, pool=self._timeouts.connect_s)
        try:
            try:
                resp = await self._http.request(method, path, json=body, params=params, timeout=t)
            except httpx.RemoteProtocolError as e:
                # Closed before any answer: nearly always a kept-alive connection that uvicorn closed
                # just as it was reused (seen under load). Asked once more on a fresh connection; safe
                # for every route here (a piece keeps its registration, so a pause still ends it) but the
                # weight-transfer ones: a second /update_weights would wait for a broadcast never sent.
                if not retry_dropped:
                    raise
                _log.debug("vllm_disconnected_retry", url=self.url, path=path, error=str(e))
                resp = await self._http.request(method, path, json=body, params=params, timeout=t)
        except httpx.TransportError as e:
            raise transport_error(f"{self.url}{path}", e) from e
        if resp.status_code >= 400:
            hint = " (is the server started with VLLM_SERVER_DEV_MODE=1?)" if resp.status_code == 404 else ""
            raise http_error(f"{self.url}{path}", resp.status_code, resp.content, hint)
        return resp.content

    async def _admin(
        self, path: str, body: Mapping[str, Any] | None = None, params: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        answer = await self._call("POST", path, body=body, params=params, timeout_s=self._timeouts.admin_s)
        return decode_json_object(answer, f"{self.url}{path}") if answer.strip() else {}

    # ---- generate ------------------------------------------------------------------------------------

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        """One generation: one piece, or several when a pause split it (see the module docstring).

        Waits for: a resume before each piece (never sent while paused), each piece's answer. A piece
        split by a retract/in_place pause is always continued; one split by an abort pause only with
        partial rollout (else the aborted output is returned). `routing_key` is not used (one server).
        """
        return await self._generate(input_ids, sampling_params, None)

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        """`generate` over vLLM's streaming completions (`stream: true`: SSE chunks, each with its new
        `token_ids` and their logprobs), awaiting `on_chunk` with every chunk's new tokens, stamped with
        their piece's version (`base.StreamingEngine`). A piece split at a pause streams on in the next
        piece; the result is what `generate` returns for the same generation."""
        return await self._generate(input_ids, sampling_params, on_chunk)

    async def _generate(
        self, input_ids: list[int], sampling_params: Mapping[str, Any], on_chunk: ChunkSink | None
    ) -> GenerateOutput:
        params = completion_params(sampling_params)
        max_new = int(params["max_tokens"])
        min_new = params.get("min_tokens")
        pieces: list[GenerateOutput] = []
        produced: list[int] = []
        while True:
            await self._resumed.wait()
            self._check_open()
            if not self._resumed.is_set():
                continue  # paused again since this wait was woken (a resume then a pause, no await between)
            if not self._version_known:
                await self.weight_version()
                continue  # a pause may have started meanwhile: wait for the gate again
            # From here to the piece's registration nothing awaits: a pause cannot slip in between.
            piece_params = {**params, "max_tokens": max_new - len(produced)}
            if isinstance(min_new, int) and min_new > 0:
                piece_params["min_tokens"] = max(0, min_new - len(produced))
            if pieces:
                self.continuations += 1
            out, split_by = await self._piece(input_ids + produced, piece_params, on_chunk)
            pieces.append(out)
            produced.extend(out.output_ids)
            if out.finish_reason != "abort" or split_by is None or len(produced) >= max_new:
                break
            if split_by == "abort" and not self.partial_rollout:
                break
            _log.debug("vllm_piece_split", url=self.url, mode=split_by, produced=len(produced))
        return pieces[0] if len(pieces) == 1 else join_pieces(pieces, max_new_tokens=max_new)

    async def _piece(
        self, prompt: list[int], params: Mapping[str, Any], on_chunk: ChunkSink | None
    ) -> tuple[GenerateOutput, PauseMode | None]:
        """One `/v1/completions` call (streamed to `on_chunk` if given), stamped with the version current
        now; also says which pause (if any) came while it was in flight."""
        rid = f"{self._rid_prefix}-{next(self._rid_counter)}"
        piece = _Piece(request_id=f"cmpl-{rid}-0", epoch=self._epoch)
        version = self._version
        self._pieces[rid] = piece  # registered with its epoch before any await: a pause sees it
        body = {
            **params,
            "prompt": prompt,
            "logprobs": 0,
            "return_token_ids": True,
            "request_id": rid,
            "stream": on_chunk is not None,
        }
        where = f"{self.url}/v1/completions request_id={rid}"
        try:
            if on_chunk is None:
                answer = decode_json_object(
                    await self._call("POST", "/v1/completions", body=body, timeout_s=self._generate_s()),
                    where,
                )
            else:
                body["stream_options"] = {"include_usage": True}
                answer = await self._stream(body, where, version, on_chunk)
        except EngineUnavailable as e:
            if isinstance(e.__cause__, httpx.TimeoutException):  # the server may still be generating
                with contextlib.suppress(EngineError):
                    await self.abort_request(rid=piece.request_id)
            raise
        finally:
            del self._pieces[rid]
            self._changed.notify()
        out = parse_completion(answer, version=version, where=where)
        if len(out.output_ids) > int(params["max_tokens"]):
            raise EngineBadResponse(
                f"{where}: {len(out.output_ids)} tokens for max_tokens={params['max_tokens']}"
            )
        return out, piece.split_by

    async def _stream(
        self, body: Mapping[str, Any], where: str, version: int | None, on_chunk: ChunkSink
    ) -> dict[str, Any]:
        """POST a streaming completion and read its SSE chunks to `[DONE]`; every chunk's new tokens go to
        `on_chunk` as they arrive. Returns the chunks joined into the non-streaming answer's shape (for
        `parse_completion`). Errors map as in `_call`; an error chunk raises, and so does a stream that
        ends without its finish reason."""
        self._check_open()
        joined = _StreamedCompletion(where)
        try:
            stream = await self._open_stream(encode_json(body))
        except httpx.TransportError as e:
            raise transport_error(where, e) from e
        try:
            if stream.status >= 400:
                raise http_error(where, stream.status, await read_all(stream))
            buffer = b""
            while piece := await stream.read():  # as it arrives: AiohttpTransport.open_stream reads no ahead
                buffer += piece.replace(b"\r\n", b"\n")
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    ids, lps = joined.add(event)
                    if ids:
                        await on_chunk(GenerateChunk(ids, lps, [version] * len(ids)))
                    if joined.done:
                        return joined.answer()
        except httpx.TransportError as e:
            raise transport_error(where, e, lost="connection lost") from e
        finally:
            await stream.aclose()
        raise EngineUnavailable(f"{where}: the stream ended before [DONE]")

    async def _open_stream(self, content: bytes) -> BodyStream:
        """POST a streaming completion; its body is read as it arrives."""
        c, g = self._timeouts.connect_s, self._generate_s()
        return await open_body_stream(
            self._transport,
            f"{self.url}/v1/completions",
            content=content,
            headers={"Content-Type": "application/json", **self._auth},
            deadlines_s={"connect": c, "total": g},
            httpx_timeout={"connect": c, "pool": c, "read": g, "write": g},
        )

    def _generate_s(self) -> float:
        return 10.0**9 if self._timeouts.generate_s is None else self._timeouts.generate_s

    # ---- pause / continue ----------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode) -> None:
        """`/pause`: `abort` → vLLM's abort (requests come back with their tokens); `retract`/`in_place` →
        vLLM's keep (frozen; split and continued at `continue_generation`). No new piece starts until
        `continue_generation`."""
        self._own_pause = False  # the caller's pause now, whoever paused first: the caller resumes it
        self._resumed.clear()
        self._epoch += 1
        self._paused = mode
        for piece in self._pieces.values():
            if piece.split_by is None:
                piece.split_by = mode
        vllm_mode = "abort" if mode == "abort" else "keep"
        await self._admin("/pause", params={"mode": vllm_mode, "clear_cache": "false"})

    async def continue_generation(self) -> None:
        """End a weight update a failed broadcast left open and every piece sent before the last pause
        (abort them, wait for their answers), then `/resume`, then let the waiting generations send their
        next pieces."""
        await self._end_open_transfer()
        await self._end_stale_pieces()
        await self._admin("/resume")
        self._paused, self._own_pause = None, False
        self._resumed.set()

    async def _pause_for_update(self) -> None:
        """Pause (retract) for a weight update that came outside a pause; it resumes once it succeeded."""
        if self._paused is None:
            await self.pause_generation("retract")
            self._own_pause = True

    async def _end_stale_pieces(self) -> None:
        """Abort the pieces from before the current epoch until none is left in flight."""

        def stale() -> list[str]:
            return [p.request_id for p in self._pieces.values() if p.epoch < self._epoch]

        while ids := stale():
            await self._admin("/abort_requests", {"request_ids": ids})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ABORT_RECHECK_S):
                    await self._changed.wait_until(lambda: not stale())

    async def flush_cache(self) -> None:
        """`/reset_prefix_cache`; while paused, with `reset_running_requests=true` (frozen requests are
        preempted and recomputed after the resume, as SGLang's retract). `{"success": false}` (blocks
        still held, e.g. aborted requests draining) raises `FlushRefused`, which the router asks again."""
        params = {"reset_running_requests": "true" if self._paused is not None else "false"}
        data = await self._admin("/reset_prefix_cache", params=params)
        if data.get("success") is not True:
            raise FlushRefused(f"{self.url}/reset_prefix_cache: answered {data!r} (blocks still in use)")

    # ---- weights -------------------------------------------------------------------------------------

    async def update_weight_version(self, version: int) -> None:
        """Stamp `version`: on the server (`/update_weight_version`, read back by `weight_version()`)
        and here, for every piece sent from now on. Aborts nothing."""
        new = wire_version(version)
        data = await self._admin("/update_weight_version", {"new_version": new})
        if data.get("new_version", new) != new:
            raise EngineBadResponse(f"{self.url}/update_weight_version: answered {data!r} to {new!r}")
        self._version, self._version_known = version, True

    async def update_weights_from_disk(
        self, model_path: str, *, version: int, flush_cache: bool = True
    ) -> None:
        """Reload the weights in place from `model_path` (an HF model dir: vLLM's `reload_weights` worker
        method through `/collective_rpc`), optionally flush the prefix cache, then stamp `version`.
        Outside a pause it pauses (retract) around the load itself, so no piece spans it, and resumes
        once the load succeeded (see `_own_pause` for a failed one)."""
        await self._end_open_transfer()
        await self._pause_for_update()
        body = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        await self._admin("/collective_rpc", body)
        await self._updated(version=version, flush_cache=flush_cache)

    async def _updated(self, *, version: int | None, flush_cache: bool) -> None:
        """A weight update succeeded: flush the prefix cache if asked, stamp `version`, and resume the
        server if the update paused it itself (`_own_pause`)."""
        if flush_cache:
            await self.flush_cache()
        if version is not None:
            await self.update_weight_version(version)
        if self._own_pause:
            await self.continue_generation()

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
        """`/init_weight_transfer_engine`: this server's workers join trainer rank 0's NCCL group from
        `rank_offset` on (it returns once the group is formed). `group_name` is not sent (one group per
        server); any backend but nccl is refused here, before the server is asked. A server still in an
        earlier group (its broadcast failed, so nobody asked it to leave) leaves it first: vLLM's init
        would replace the old communicator without destroying it."""
        if backend != "nccl":
            raise EngineBadResponse(f"{self.url}: {_NCCL_ONLY} (asked for {backend})")
        await self._end_open_transfer()
        if self._in_group:
            with contextlib.suppress(EngineError):  # a broken group may not shut down cleanly
                await self._leave_group()
        init_info = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "packed": False,  # one broadcast per tensor, in `names` order, as the trainer sends them
        }
        self._in_group = True  # also if the answer is lost: the workers may have joined
        await self._call(
            "POST",
            "/init_weight_transfer_engine",
            body={"init_info": init_info},
            timeout_s=self._timeouts.admin_s,
            retry_dropped=False,
        )

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        last_bucket: bool = True,
    ) -> None:
        """Receive one bucket by NCCL broadcast from trainer rank 0 (`/update_weights`). vLLM applies a
        push as ONE update (a fused layer, e.g. qkv_proj, may take its parts from two buckets), so the
        push's first bucket starts it (`/start_weight_update`) and its last finishes it
        (`/finish_weight_update`), then flushes the prefix cache if asked and stamps `version`. Outside a
        pause it pauses (retract) from the first bucket to the last, so no piece spans the update, and
        resumes once the update succeeded (see `_own_pause` for a failed one)."""
        admin = self._timeouts.admin_s
        if not self._transfer_open:
            await self._pause_for_update()
            self._transfer_open = True
            await self._call("POST", "/start_weight_update", timeout_s=admin, retry_dropped=False)
        update_info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        body = {"update_info": update_info}
        await self._call("POST", "/update_weights", body=body, timeout_s=admin, retry_dropped=False)
        if last_bucket:
            await self._finish_transfer()
            await self._updated(version=version, flush_cache=flush_cache)

    async def _finish_transfer(self) -> None:
        """`/finish_weight_update`: end the update the first bucket started (also after a failed one:
        vLLM refuses to leave the group during an update). Asked once: a failure is not asked again."""
        if self._transfer_open:
            self._transfer_open = False
            admin = self._timeouts.admin_s
            await self._call("POST", "/finish_weight_update", body={}, timeout_s=admin, retry_dropped=False)

    async def _end_open_transfer(self) -> None:
        """Finish an update a failed broadcast left open (the trainer then sends that push by disk and
        forms a new group): vLLM's loaders stay wrapped for the update until it is finished. It leaves
        the engine paused; what comes next (a disk load, a resume) decides."""
        if self._transfer_open:
            _log.warning("vllm_weight_update_left_open", url=self.url)
            with contextlib.suppress(EngineError):  # a broken group's update may not finish cleanly
                await self._finish_transfer()

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """`/shutdown_weight_transfer_engine`: leave the trainer's NCCL group (ending an update a failed
        broadcast left open first)."""
        await self._end_open_transfer()
        await self._leave_group()

    async def _leave_group(self) -> None:
        await self._call("POST", "/shutdown_weight_transfer_engine", timeout_s=self._timeouts.admin_s)
        self._in_group = False

    def weight_broadcast(self) -> SingleServerBroadcast:
        """This server alone takes a weight push by broadcast (NCCL only: vLLM has no gloo transfer)."""
        return SingleServerBroadcast(self)

    # ---- abort, health, info -------------------------------------------------------------------------

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        """`/abort_requests` for one vLLM request id (`cmpl-<request_id>-0`), or every request."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        body = {"request_ids": [] if abort_all else [rid]}
        await self._call("POST", "/abort_requests", body=body, timeout_s=self._timeouts.health_s)

    async def health_generate(self) -> None:
        """A 1-token greedy completion (vLLM's /health does not generate); raises EngineError unless 200."""
        body = {"prompt": [0], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        await self._call("POST", "/v1/completions", body=body, timeout_s=self._timeouts.health_s)

    async def weight_version(self) -> int | None:
        """The server's stamped version (`/weight_info`; vLLM's `"default"` is None)."""
        where = f"{self.url}/weight_info"
        info = decode_json_object(
            await self._call("GET", "/weight_info", timeout_s=self._timeouts.health_s), where
        )
        version = parse_wire_version(info.get("weight_version"), where)
        if not self._version_known:
            self._version, self._version_known = version, True
        return version

    async def server_info(self) -> dict[str, Any]:
        """What the router and `engines` read, from vLLM's dev `/server_info` and `/version`: `engine`
        ("vllm"), `version`, `tp_size`, `disable_radix_cache` (prefix caching off), `weight_version`."""
        h = self._timeouts.health_s
        raw = decode_json_object(
            await self._call("GET", "/server_info", timeout_s=h), f"{self.url}/server_info"
        )
        config = str(raw.get("vllm_config", ""))
        version = decode_json_object(await self._call("GET", "/version", timeout_s=h), f"{self.url}/version")
        prefix = re.search(r"enable_prefix_caching=(True|False)", config)
        tp = re.search(r"tensor_parallel_size=(\d+)", config)
        return {
            "engine": "vllm",
            "version": version.get("version"),
            "tp_size": int(tp.group(1)) if tp else 1,
            "disable_radix_cache": None if prefix is None else prefix.group(1) == "False",
            "weight_version": await self.weight_version(),
        }


_NCCL_ONLY: Final = (
    "vLLM's weight transfer is NCCL only (GPU trainer and servers); on a CPU use "
    "--update-weight-transfer-mode disk"
)


class _StreamedCompletion:
    """The SSE events of one streaming completion, joined: each `data:` chunk's `token_ids`, logprobs and
    text are deltas; its `finish_reason` ends the choice; the usage chunk (`include_usage`) has no
    choices; `[DONE]` ends the stream. Malformed chunks raise EngineBadResponse, error chunks the error."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.done = False
        self.ids: list[int] = []
        self.lps: list[object] = []
        self.text: list[str] = []
        self.finish: object = None
        self.usage: object = None
        self.id: object = None

    def add(self, event: bytes) -> tuple[list[int], list[float]]:
        """Take one SSE event; returns its new token ids and their logprobs (validated)."""
        lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
        if not lines:
            return [], []  # a comment or keep-alive
        data = b"\n".join(lines)
        if data == b"[DONE]":
            if self.finish is None and not self.ids:
                # vLLM sends no chunk for a request that ends with no token: only an abort does that
                self.finish = "abort"
            elif self.finish is None:
                raise EngineBadResponse(f"{self.where}: [DONE] before a chunk with a finish reason")
            self.done = True
            return [], []
        chunk = decode_json_object(data, self.where)
        if (error := chunk.get("error")) is not None:
            code = error.get("code") if isinstance(error, dict) else None
            raise http_error(self.where, code if type(code) is int else 500, data)
        self.id = chunk.get("id", self.id)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if choices == []:
            return [], []  # the usage chunk
        if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
            raise EngineBadResponse(f"{self.where}: expected one choice per chunk, got {str(choices)[:80]}")
        choice: dict[str, Any] = choices[0]
        ids = choice.get("token_ids") or []
        logprobs = choice.get("logprobs")
        lps = (logprobs.get("token_logprobs") if type(logprobs) is dict else None) or []
        if type(ids) is not list or not all(type(t) is int and t >= 0 for t in ids):
            raise EngineBadResponse(f"{self.where}: token_ids must be a list of token ids (return_token_ids)")
        if type(lps) is not list or len(lps) != len(ids):
            raise EngineBadResponse(f"{self.where}: {len(ids)} token_ids but logprobs {str(lps)[:80]}")
        if not all(type(lp) in (float, int) and lp <= 0.0 for lp in lps):
            raise EngineBadResponse(f"{self.where}: token_logprobs must be numbers <= 0")
        if type(text := choice.get("text", "")) is str:
            self.text.append(text)
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        self.ids.extend(ids)
        self.lps.extend(lps)
        return ids, [float(lp) for lp in lps]

    def answer(self) -> dict[str, Any]:
        """The joined chunks in the non-streaming answer's shape."""
        choice = {
            "index": 0,
            "text": "".join(self.text),
            "token_ids": self.ids,
            "logprobs": {"token_logprobs": self.lps},
            "finish_reason": self.finish,
        }
        return {"id": self.id, "choices": [choice], "usage": self.usage}


def parse_completion(body: Mapping[str, Any], *, version: int | None, where: str) -> GenerateOutput:
    """Validate one non-streaming `/v1/completions` answer (with `return_token_ids` and `logprobs: 0`)
    and decode it, every token stamped `version`; EngineBadResponse if it breaks that contract."""
    choices = body.get("choices")
    if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
        raise EngineBadResponse(f"{where}: expected one choice, got {str(choices)[:80]}")
    choice: dict[str, Any] = choices[0]
    finish = _FINISH.get(choice.get("finish_reason"))
    if finish is None:
        raise EngineBadResponse(
            f"{where}: finish_reason {choice.get('finish_reason')!r} is not stop|length|abort"
        )
    ids = choice.get("token_ids")
    if type(ids) is not list or not all(type(t) is int and t >= 0 for t in ids):
        raise EngineBadResponse(f"{where}: token_ids must be a list of token ids (return_token_ids)")
    logprobs = choice.get("logprobs")
    lps = logprobs.get("token_logprobs") if type(logprobs) is dict else None
    if not ids and lps is None:
        lps = []
    if type(lps) is not list or len(lps) != len(ids):
        raise EngineBadResponse(f"{where}: {len(ids)} token_ids but logprobs {str(lps)[:80]}")
    if not all(type(lp) in (float, int) and lp <= 0.0 for lp in lps):
        raise EngineBadResponse(f"{where}: token_logprobs must be numbers <= 0")
    text = choice.get("text", "")
    if type(text) is not str:
        raise EngineBadResponse(f"{where}: text must be a string")
    usage = body.get("usage")
    usage = usage if type(usage) is dict else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if type(details) is dict else None
    prompt_tokens = usage.get("prompt_tokens")
    return GenerateOutput(
        text=text,
        output_ids=ids,
        output_log_probs=[float(lp) for lp in lps],
        weight_versions=[version] * len(ids),
        finish_reason=finish,
        prompt_tokens=prompt_tokens if type(prompt_tokens) is int else 0,
        cached_tokens=cached if type(cached) is int else 0,
        meta={"id": body.get("id")},
    )

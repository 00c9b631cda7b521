"""`SessionServer`: the OpenAI-compatible endpoint agents talk to, served from the controller's event loop.

    POST /sessions/{id}/v1/chat/completions   consumes an OpenAI chat request (the whole conversation
                                              so far); produces a `chat.completion` or its SSE chunks
    GET  /sessions/{id}/v1/models             the one model, "default"

One aiohttp server in the controller's process and loop (no extra process, no thread); `serve()` is a
task of the caller's TaskGroup: it binds (127.0.0.1, a free port by default), sets `ready`, then waits
until cancelled, and on the way out seals every session, calls the agent module's `abort(args)` hook if
it has one and closes the server. Binding elsewhere needs `--session-server-api-key`; a key given is
enforced on every route (`Authorization: Bearer <key>`, 401 otherwise).

Each rollout gets its own session (`session(...)`: an unguessable id from `secrets.token_urlsafe`, its
`base_url`, removed when the rollout's agent is done). A request is answered under the session's lock:

  1. `tito.plan_turn` matches the resent history against the session's (`--session-message-matcher`);
     a divergence is 400 `history_diverged` with the reason, and changes nothing;
  2. `tito.next_prompt` builds the engine input from the session's own tokens plus the rendered,
     tokenized suffix; the budget left under `--max-seq-len` / `--rollout-max-context-len` caps
     `max_new_tokens` (none left: an empty reply, finish reason "length", no engine call);
  3. one `ctx.engine.generate` call (the rollout's limiter slot, router, retries, partial-rollout
     continuation, per-token versions) with `routing_key` = the session id, so every turn lands on the
     same engine and reuses its prefix cache; an engine failure is 503 `engine_unavailable`;
  4. the reply text (special tokens skipped, a matched stop string cut, as OpenAI does) goes through the
     `--session-tool-call-parser`; a call is recorded as a turn (a rolled-back turn is dropped first),
     and the answer is sent.

With `stream: true` step 3 is `generate_stream` (SGLang's streaming `/generate`, the same limiter slot
for the whole stream, routing, retries until the first token, partial-rollout continuation): the SSE
answer starts with the engine's first tokens and carries a content delta per engine chunk, as much of
the text as is surely the start of the final content (`streaming.ContentStream`: no partial tool call,
stop string or character); the tool calls, the rest of the content, the finish reason and the usage
follow once the reply is complete. The turn recorded is the same as without streaming, token for token.

A request for an unknown or ended session is 404 `session_not_found`; one whose session ended while its
engine call ran is 409 `session_ended` (its tokens are not part of the sample).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import structlog
from aiohttp import web

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.chat_template import ChatTemplate, ChatTemplateError
from miles_aio.errors import EngineError
from miles_aio.inference.base import ChunkSink, GenerateChunk, generate_streamed
from miles_aio.rollout.agent.matchers import MessageMatcher
from miles_aio.rollout.agent.parsers import ParsedReply, ToolCallParser
from miles_aio.rollout.agent.protocol import (
    ChatRequest,
    RequestError,
    StreamHead,
    completion,
    decode_body,
    encode_json,
    error_body,
    parse_chat_request,
    stream_error,
)
from miles_aio.rollout.agent.session import Session, Turn
from miles_aio.rollout.agent.streaming import ContentStream
from miles_aio.rollout.agent.tito import HistoryDiverged, TurnTokens, next_prompt, plan_turn
from miles_aio.types import GenerateOutput

if TYPE_CHECKING:
    from miles_aio.rollout.context import RolloutContext, Tokenizer

__all__ = ["SessionServer"]

_log = structlog.get_logger("miles_aio.rollout.agent")
_LISTEN_BACKLOG: Final = 4096
"""Pending connections the listening socket queues (aiohttp's 128 drops connects under a burst)."""
_SHUTDOWN_TIMEOUT_S: Final = 1.0
AbortHook = Callable[[Any], Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SessionServer:
    """The session endpoint (see the module docstring). Construct it, run `serve()` in a TaskGroup, and
    open one `session(...)` per rollout once `ready` is set."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        matcher: MessageMatcher,
        parser: ToolCallParser,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_seq_len: int | None = None,
        max_context_len: int | None = None,
        abort_hook: AbortHook | None = None,
        abort_args: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.matcher = matcher
        self.parser = parser
        self.host = host
        self.port = port
        self.api_key = api_key
        self.max_seq_len = max_seq_len
        self.max_context_len = max_context_len
        self._abort_hook = abort_hook
        self._abort_args = abort_args
        self._encode, self._decode = _codec(tokenizer, template)
        self._sessions: dict[str, Session] = {}
        self.ready = asyncio.Event()
        """Set once the server listens (`root_url` is known)."""
        self.root_url = ""
        self.stopping = False
        """Set when serving ends (the run is over): agents that fail from then on are not at fault."""

    # ---- lifecycle ---------------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Bind, set `ready`, then serve until cancelled; on the way out seal every session, call the abort
        hook and close the server (see the module docstring). Consumes nothing; produces answers."""
        app = web.Application(middlewares=[self._auth_middleware()])
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._errors(self._chat))
        app.router.add_get("/sessions/{sid}/v1/models", self._errors(self._models))
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        try:
            # Every rollout's agent opens connections of its own, hundreds at once at a step's start:
            # aiohttp's default listen backlog (128) drops connects and stalls them for seconds.
            site = web.TCPSite(runner, self.host, self.port, backlog=_LISTEN_BACKLOG)
            await site.start()
            self.port = int(runner.addresses[0][1])
            self.root_url = f"http://{_url_host(self.host)}:{self.port}"
            _log.info("agent sessions: serving", url=self.root_url)
            self.ready.set()
            await asyncio.Event().wait()  # until cancelled: the run is over
        finally:
            self.stopping = True
            for s in self._sessions.values():
                s.closed = True
            await finish_even_if_cancelled(self._shutdown(runner))

    async def _shutdown(self, runner: web.AppRunner) -> None:
        if self._abort_hook is not None:
            try:
                result = self._abort_hook(self._abort_args)
                if inspect.isawaitable(result):
                    await result
            except Exception as e:  # a teardown hook that fails must not hide why the run ends
                _log.error("agent abort hook failed", error=f"{type(e).__name__}: {e}")
        await runner.cleanup()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SessionServer]:
        """Serve for the duration of the block, in a TaskGroup of its own (tests, embedding)."""
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(self.serve(), name="agent-session-server")
            await self.ready.wait()
            try:
                yield self
            finally:
                task.cancel()

    @contextlib.asynccontextmanager
    async def session(
        self, ctx: RolloutContext, sampling_params: Mapping[str, Any]
    ) -> AsyncIterator[Session]:
        """A new session for one rollout, on `ctx`'s engine; sealed and removed when the block ends."""
        if not self.ready.is_set():
            raise RuntimeError("the session server is not serving (its serve() task has not started)")
        sid = secrets.token_urlsafe(16)
        session = Session(
            id=sid,
            base_url=f"{self.root_url}/sessions/{sid}/v1",
            ctx=ctx,
            sampling_params=dict(sampling_params),
        )
        self._sessions[sid] = session
        try:
            yield session
        finally:
            session.closed = True
            del self._sessions[sid]

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # ---- HTTP -----------------------------------------------------------------------------------------

    def _auth_middleware(self) -> Any:
        key = self.api_key

        @web.middleware
        async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
            if key is not None:
                scheme, _, token = request.headers.get("Authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), key.encode()):
                    err = RequestError("missing or wrong API key", status=401, code="invalid_api_key")
                    return web.json_response(error_body(err), status=401)
            return await handler(request)

        return auth

    def _errors(self, handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except RequestError as e:
                return web.json_response(error_body(e), status=e.status)

        return wrapped

    def _lookup(self, request: web.Request) -> Session:
        session = self._sessions.get(request.match_info["sid"])
        if session is None or session.closed:
            raise RequestError(
                "session not found: it ended (its rollout is over) or never existed",
                status=404,
                code="session_not_found",
            )
        return session

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self._lookup(request)
        card = {"id": "default", "object": "model", "created": 0, "owned_by": "miles_aio"}
        return web.json_response({"object": "list", "data": [card]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._lookup(request)
        session.calls += 1
        req = parse_chat_request(decode_body(await request.read()))
        async with session.lock:
            if session.closed:
                self._lookup(request)  # raises 404
            turn = self._prepare(session, req)
            if turn.params is None:  # no room left: an empty reply, no engine call
                session.out_of_budget = True
                empty = {"role": "assistant", "content": None}
                a = _Answer(empty, "length", turn.usage(0), [] if req.logprobs else None, {})
            elif req.stream:
                return await self._stream(request, session, req, turn)
            else:
                out = await self._generate(session, turn, None)
                a = self._record(session, req, turn, out, logprobs=req.logprobs)
        if not req.stream:
            body = completion(
                rid=turn.rid,
                created=turn.created,
                model=req.model,
                message=a.message,
                finish_reason=a.finish_reason,
                usage=a.usage,
                logprobs=a.logprobs,
                metadata=a.metadata,
            )
            return web.Response(body=encode_json(body), content_type="application/json")
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        for chunk in StreamHead(turn.rid, turn.created, req.model).whole(
            message=a.message,
            finish_reason=a.finish_reason,
            usage=a.usage,
            include_usage=req.include_usage,
            logprobs=a.logprobs,
        ):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def _stream(
        self, request: web.Request, session: Session, req: ChatRequest, turn: _Prepared
    ) -> web.StreamResponse:
        """Step 3-4 streamed: the answer's status line goes out with the engine's first tokens (an engine
        that fails before them is a plain 503), then a content delta per engine chunk (what
        `ContentStream` can show), and once the reply is complete its tool calls, finish reason and usage.
        A failure after the first chunk is an error event."""
        head = StreamHead(turn.rid, turn.created, req.model)
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        stops = turn.params.get("stop") if turn.params else None
        content = ContentStream(
            decode=self._decode_skipping_special,
            parser=self.parser if req.parse_tools else None,
            stops=[stops] if isinstance(stops, str) else list(stops or ()),
        )

        async def start() -> None:
            await resp.prepare(request)
            await resp.write(head.chunk({"role": "assistant", "content": ""}))

        async def on_chunk(chunk: GenerateChunk) -> None:
            if not resp.prepared:
                await start()
            delta = content.push(chunk.output_ids)
            lp = self._logprobs(chunk.output_ids, chunk.output_log_probs) if req.logprobs else None
            if delta or lp:
                await resp.write(head.chunk({"content": delta}, logprobs=lp))

        try:
            out = await self._generate(session, turn, on_chunk)
        except RequestError as e:
            if not resp.prepared:
                raise
            await resp.write(stream_error(e))
            await resp.write_eof()
            return resp
        a = self._record(session, req, turn, out, logprobs=False)
        if not resp.prepared:
            await start()
        rest = content.finish(a.message["content"])
        if rest is None:
            _log.warning(
                "agent sessions: the streamed content is not the start of the reply's content",
                streamed=content.sent[:200],
                content=str(a.message["content"])[:200],
            )
        elif rest:
            await resp.write(head.chunk({"content": rest}))
        for chunk in head.tail(
            message=a.message,
            finish_reason=a.finish_reason,
            usage=a.usage,
            include_usage=req.include_usage,
        ):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    # ---- one turn ---------------------------------------------------------------------------------------

    def _prepare(self, session: Session, req: ChatRequest) -> _Prepared:
        """Steps 1-2 of the module docstring (under the session's lock): the engine input and params."""
        try:
            plan = plan_turn(session.turns, req.messages, matcher=self.matcher, tools=req.tools)
            kept = session.turns[plan.keep - 1].tokens if plan.keep else None
            prompt_ids = next_prompt(
                kept, req.messages, plan.prefix_len, render=self._renderer(req.tools), encode=self._encode
            )
        except HistoryDiverged as e:
            raise RequestError(str(e), code="history_diverged", param="messages") from None
        except ChatTemplateError as e:
            raise RequestError(str(e), code="chat_template_error", param="messages") from None
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        params: dict[str, Any] = {**session.sampling_params, **req.sampling}
        if req.stop:
            params["stop"] = list(req.stop)
        max_new = req.max_tokens if req.max_tokens is not None else int(params.get("max_new_tokens", 1024))
        limits = [n for n in (self.max_seq_len, self.max_context_len) if n is not None]
        budget = min((n - len(prompt_ids) for n in limits), default=max_new)
        if budget <= 0:
            return _Prepared(plan.keep, prompt_ids, None, rid, created)
        params["max_new_tokens"] = min(max_new, budget)
        return _Prepared(plan.keep, prompt_ids, params, rid, created)

    async def _generate(
        self, session: Session, turn: _Prepared, on_chunk: ChunkSink | None
    ) -> GenerateOutput:
        """Step 3: one engine call (streamed when `on_chunk` is given); 503 if the engine fails, 409 if the
        session ended meanwhile."""
        assert turn.params is not None
        try:
            if on_chunk is None:
                out = await session.ctx.engine.generate(
                    input_ids=turn.prompt_ids, sampling_params=turn.params, routing_key=session.id
                )
            else:
                out = await generate_streamed(
                    session.ctx.engine,
                    input_ids=turn.prompt_ids,
                    sampling_params=turn.params,
                    on_chunk=on_chunk,
                    routing_key=session.id,
                )
        except EngineError as e:
            session.engine_error = f"{type(e).__name__}: {e}"
            raise RequestError(
                f"the engine failed: {e}", status=503, code="engine_unavailable", err_type="server_error"
            ) from None
        if session.closed:
            raise RequestError(
                "the session ended while this request ran: its reply is not part of the rollout",
                status=409,
                code="session_ended",
            )
        return out

    def _record(
        self, session: Session, req: ChatRequest, turn: _Prepared, out: GenerateOutput, *, logprobs: bool
    ) -> _Answer:
        """Step 4: the reply the agent sees, recorded as the session's newest turn."""
        text = self._decode_skipping_special(out.output_ids)
        finish_meta = out.meta.get("finish_reason")
        matched = finish_meta.get("matched") if isinstance(finish_meta, dict) else None
        if isinstance(matched, str) and matched and text.endswith(matched):
            text = text[: -len(matched)]
        parsed = self.parser(text) if req.parse_tools else ParsedReply(content=text or None)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{session.call_ids + i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for i, c in enumerate(parsed.tool_calls)
            ]
            session.call_ids += len(parsed.tool_calls)
        finish = "tool_calls" if parsed.tool_calls and out.finish_reason == "stop" else out.finish_reason
        if turn.keep < len(session.turns):
            session.rollbacks += len(session.turns) - turn.keep
            del session.turns[turn.keep :]
        session.turns.append(
            Turn(
                messages=req.messages,
                reply=message,
                tools=req.tools,
                tokens=TurnTokens(
                    turn.prompt_ids,
                    list(out.output_ids),
                    list(out.output_log_probs),
                    list(out.weight_versions),
                ),
                finish_reason=out.finish_reason,
            )
        )
        session.engine_error = None
        usage = turn.usage(len(out.output_ids))
        usage["prompt_tokens_details"] = {"cached_tokens": out.cached_tokens}
        lp = self._logprobs(out.output_ids, out.output_log_probs) if logprobs else None
        known = [v for v in out.weight_versions if v is not None]
        meta = {"weight_version": known[-1] if known else None}
        return _Answer(message, finish, usage, lp, meta)

    def _logprobs(self, ids: Sequence[int], log_probs: Sequence[float]) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content` entries of these tokens."""
        return [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
            for tok, lp in zip(self._token_texts(ids), log_probs, strict=True)
        ]

    def _renderer(
        self, tools: Sequence[Mapping[str, Any]] | None
    ) -> Callable[[Sequence[Mapping[str, Any]], bool], str]:
        def render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
            return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

        return render

    def _token_texts(self, ids: Sequence[int]) -> list[str]:
        return [self._decode([i], False) for i in ids]

    def _decode_skipping_special(self, ids: Sequence[int]) -> str:
        return self._decode(ids, True)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A request's engine call, planned (steps 1-2)."""

    keep: int
    """Stored turns the request continues (later ones are rolled back once it is answered)."""
    prompt_ids: list[int]
    params: dict[str, Any] | None
    """The engine call's sampling params; None: no room left for a reply (no call)."""
    rid: str
    created: int

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        n = len(self.prompt_ids)
        return {
            "prompt_tokens": n,
            "completion_tokens": completion_tokens,
            "total_tokens": n + completion_tokens,
        }


@dataclass(frozen=True, slots=True)
class _Answer:
    message: dict[str, Any]
    finish_reason: str
    usage: dict[str, Any]
    logprobs: list[dict[str, Any]] | None
    metadata: dict[str, Any]


_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _codec(
    tokenizer: Tokenizer, template: ChatTemplate
) -> tuple[Callable[[str], list[int]], Callable[[Sequence[int], bool], str]]:
    """`encode(text)` (no special tokens added) and `decode(ids, skip_special_tokens)` for the endpoint:
    a Hugging Face fast tokenizer's own Rust backend, which is what its `encode`/`decode` call, without
    their ~40-60 µs of Python per call, once a probe (a rendered conversation) shows that both give the
    same ids and texts; the tokenizer's methods otherwise."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return encode, decode

    def fast_encode(text: str) -> list[int]:
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        return ids

    def fast_decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        text: str = backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    try:
        probe = template.render(
            [{"role": "user", "content": "Hi, 12+34 = ?"}, {"role": "assistant", "content": " 46. ok"}],
            add_generation_prompt=True,
        )
        ids = encode(probe)
        same = fast_encode(probe) == ids and all(
            fast_decode(ids, skip) == decode(ids, skip) for skip in (True, False)
        )
    except Exception:  # a backend unlike `tokenizers.Tokenizer`: the tokenizer's own methods
        return encode, decode
    return (fast_encode, fast_decode) if same else (encode, decode)


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host

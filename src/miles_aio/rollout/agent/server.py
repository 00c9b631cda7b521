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
     and the answer is sent, streamed as SSE chunks if asked (the engine call itself is one /generate:
     the limiter and partial rollout need the whole answer).

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
from miles_aio.rollout.agent.matchers import MessageMatcher
from miles_aio.rollout.agent.parsers import ParsedReply, ToolCallParser
from miles_aio.rollout.agent.protocol import (
    ChatRequest,
    RequestError,
    completion,
    error_body,
    parse_chat_request,
    stream_chunks,
)
from miles_aio.rollout.agent.session import Session, Turn
from miles_aio.rollout.agent.tito import HistoryDiverged, TurnTokens, next_prompt, plan_turn

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
        try:
            body = await request.json()
        except ValueError:
            raise RequestError("the request body is not JSON") from None
        req = parse_chat_request(body)
        async with session.lock:
            if session.closed:
                self._lookup(request)  # raises 404
            a = await self._turn(session, req)
        if not req.stream:
            return web.json_response(
                completion(
                    rid=a.rid,
                    created=a.created,
                    model=req.model,
                    message=a.message,
                    finish_reason=a.finish_reason,
                    usage=a.usage,
                    logprobs=a.logprobs,
                    metadata=a.metadata,
                )
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in stream_chunks(
            rid=a.rid,
            created=a.created,
            model=req.model,
            message=a.message,
            finish_reason=a.finish_reason,
            usage=a.usage,
            include_usage=req.include_usage,
            logprobs=a.logprobs,
        ):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    # ---- one turn ---------------------------------------------------------------------------------------

    async def _turn(self, session: Session, req: ChatRequest) -> _Answer:
        """Steps 1-4 of the module docstring, under the session's lock."""
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
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": 0,
            "total_tokens": len(prompt_ids),
        }
        if budget <= 0:
            session.out_of_budget = True
            empty = {"role": "assistant", "content": None}
            return _Answer(rid, created, empty, "length", usage, [] if req.logprobs else None, {})
        params["max_new_tokens"] = min(max_new, budget)
        try:
            out = await session.ctx.engine.generate(
                input_ids=prompt_ids, sampling_params=params, routing_key=session.id
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
        text = self.tokenizer.decode(list(out.output_ids), skip_special_tokens=True)
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
        if plan.keep < len(session.turns):
            session.rollbacks += len(session.turns) - plan.keep
            del session.turns[plan.keep :]
        session.turns.append(
            Turn(
                messages=req.messages,
                reply=message,
                tools=req.tools,
                tokens=TurnTokens(
                    prompt_ids, list(out.output_ids), list(out.output_log_probs), list(out.weight_versions)
                ),
                finish_reason=out.finish_reason,
            )
        )
        session.engine_error = None
        n = len(out.output_ids)
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n,
            "total_tokens": len(prompt_ids) + n,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }
        logprobs = None
        if req.logprobs:
            logprobs = [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                for tok, lp in zip(self._token_texts(out.output_ids), out.output_log_probs, strict=True)
            ]
        known = [v for v in out.weight_versions if v is not None]
        meta = {"weight_version": known[-1] if known else None}
        return _Answer(rid, created, message, finish, usage, logprobs, meta)

    def _renderer(
        self, tools: Sequence[Mapping[str, Any]] | None
    ) -> Callable[[Sequence[Mapping[str, Any]], bool], str]:
        def render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
            return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

        return render

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _token_texts(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


@dataclass(frozen=True, slots=True)
class _Answer:
    rid: str
    created: int
    message: dict[str, Any]
    finish_reason: str
    usage: dict[str, Any]
    logprobs: list[dict[str, Any]] | None
    metadata: dict[str, Any]


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host

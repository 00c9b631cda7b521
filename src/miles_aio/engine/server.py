"""The embedded engine's HTTP server: SGLang's native API (a subset) over aiohttp.

Process layout: one event loop runs aiohttp and `LocalEngine.run()` in one TaskGroup; model compute and
weight copies run on one dedicated compute thread; blocking torch.distributed calls (rendezvous,
broadcast receive) and checkpoint reads run in `asyncio.to_thread`, so none of them stalls HTTP.

Responses follow SGLang byte for byte where it matters to clients: `/generate` answers
`{text, output_ids, meta_info}`; a request that breaks the wire schema gets 400 `{"error": "<text>"}`, and
one the engine refuses for its content gets 400 `{"error": {"message": ...}}`; weight endpoints answer
`{"success", "message", ...}`, 200 or 400 (a weight/abort body that breaks SGLang's schema: its validation
error, 400 `{"object": "error", "message", "type", "param", "code"}`); a request aborted with a status (the
request timeouts: 503) answers that ErrorResponse too; `/flush_cache` answers plain text. With
`--api-key`, every route except `/health*` and `/ready` needs `Authorization: Bearer <key>` (401 otherwise).
OpenAI-compatible `/v1/models`, `/v1/completions`, `/v1/chat/completions`: see `openai.py`.

Lifecycle (`serve`): load the model, bind, write ONE JSON "ready" line to stdout, serve until SIGTERM/
SIGINT (or stdin EOF with `--exit-on-stdin-eof`: the launcher's pipe closes when its process dies), then
abort in-flight requests (they answer with finish_reason abort) and stop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import structlog
import torch
from aiohttp import web
from tokenizers import Tokenizer

from miles_aio import weight_broadcast as weight_sync
from miles_aio.chat_template import ChatTemplate, ChatTemplateError
from miles_aio.engine import protocol as proto
from miles_aio.engine.core import EngineClosed, LocalEngine, RequestAborted
from miles_aio.engine.handlers import GenerationHandlers
from miles_aio.engine.model import LlamaModel, LlamaSpec
from miles_aio.engine.openai import OpenAIHandlers
from miles_aio.engine.runner import ModelRunner
from miles_aio.engine.state import ServerConfig, ServerState, bad_request, error_response
from miles_aio.engine.timeouts import Supervisor
from miles_aio.engine.weight_handlers import WeightHandlers

__all__ = ["ServerConfig", "build_app", "serve"]

_log = structlog.get_logger(__name__)
_OPEN_PATHS: Final = ("/health", "/ready", "/metrics")  # exempt from the API key, as in SGLang
_SHUTDOWN_TIMEOUT_S: Final = 5.0
_LISTEN_BACKLOG: Final = 4096
"""Pending connections the listening socket queues (aiohttp's 128 drops connects under a burst)."""
FAULT_TOKEN_ENV: Final = "MILES_AIO_ENGINE_FAULT_TOKEN"
"""Fault injection for tests: every forward step that feeds this token id raises (see `ModelRunner`)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(cfg: ServerConfig) -> None:
    """Run the server until a signal (or stdin EOF); see the module docstring."""
    torch.set_num_threads(cfg.num_threads)
    model_path = cfg.model_path.resolve()
    spec = LlamaSpec.from_model_dir(model_path)
    context_len = min(cfg.context_length or spec.max_position_embeddings, spec.max_position_embeddings)
    model = LlamaModel.load(model_path, context_len=context_len)
    tok_file = model_path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.exists() else None
    if tokenizer is None:
        _log.warning("engine.no_tokenizer", hint="text input is refused and output text is empty")
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-compute")
    fault = os.environ.get(FAULT_TOKEN_ENV)
    runner = ModelRunner(
        model,
        max_running=cfg.max_running_requests,
        context_len=context_len,
        fault_token=int(fault) if fault else None,
    )

    state = ServerState(
        cfg=cfg,
        model=model,
        executor=executor,
        tokenizer=tokenizer,
        chat_template=_load_chat_template(model_path),
        model_path=model_path,
        weights_root=(cfg.weights_root or model_path.parent).resolve(),
        engine=LocalEngine(
            runner,
            executor=executor,
            detokenize=functools.partial(stop_match_text, tokenizer),
            context_len=context_len,
            weight_version=cfg.weight_version,
            prefix_cache_entries=cfg.prefix_cache_entries,
            seed=cfg.seed,
        ),
    )
    _log.info(
        "engine.loaded",
        model=str(model_path),
        context_len=context_len,
        kv_bytes=runner.kv.nbytes,
        threads=cfg.num_threads,
    )
    app = build_app(state)
    app_runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S
    )
    await app_runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(app_runner, cfg.host, cfg.port, backlog=_LISTEN_BACKLOG)  # many clients at once
        await site.start()
        state.port = app_runner.addresses[0][1]
        async with asyncio.TaskGroup() as tg:
            tg.create_task(state.engine.run(), name="engine-scheduler")
            supervisor = Supervisor(
                engine=state.engine,
                limits=cfg.request_timeouts,
                watchdog_timeout_s=cfg.watchdog_timeout,
                soft_watchdog_timeout_s=cfg.soft_watchdog_timeout,
            )
            tg.create_task(supervisor.run(), name="engine-timeouts")
            watcher = (
                tg.create_task(_watch_stdin(stop), name="stdin-watch") if cfg.exit_on_stdin_eof else None
            )
            ready = {"event": "ready", "host": cfg.host, "port": state.port, "pid": os.getpid()}
            sys.stdout.write(json.dumps(ready) + "\n")  # the launcher waits on this line
            sys.stdout.flush()
            # From here on stdout is stderr: the launcher stops reading the pipe after the ready line, so
            # nothing (a chatty library) may ever fill it and block this process.
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
            _log.info("engine.ready", host=cfg.host, port=state.port)
            await stop.wait()
            _log.info("engine.stopping")
            state.engine.close()  # wakes run(); in-flight /generate calls answer with finish_reason abort
            if watcher is not None:
                watcher.cancel()
    finally:
        await app_runner.cleanup()
        executor.shutdown(wait=True)
        for pg in state.groups.values():
            weight_sync.destroy_process_group(pg)


def _load_chat_template(model_path: Path) -> ChatTemplate | None:
    """The model's chat template for /v1/chat/completions; a broken one is logged, not fatal."""
    try:
        return ChatTemplate.load(model_path)
    except ChatTemplateError as exc:
        _log.warning("engine.chat_template_unusable", error=str(exc), hint="/v1/chat/completions answers 400")
        return None


async def _watch_stdin(stop: asyncio.Event) -> None:
    """Set `stop` at stdin EOF: the launcher holds the write end, so EOF means it is gone."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass
    _log.warning("engine.stdin_closed", hint="the launching process is gone; shutting down")
    stop.set()


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[_auth_middleware(state.cfg.api_key), _error_middleware], client_max_size=1 << 26
    )
    g, w = GenerationHandlers(state), WeightHandlers(state)
    routes: list[tuple[str, str, Handler]] = [
        ("POST", "/generate", g.generate), ("PUT", "/generate", g.generate),
        ("POST", "/abort_request", g.abort_request),
        ("POST", "/pause_generation", g.pause_generation),
        ("POST", "/continue_generation", g.continue_generation),
        ("GET", "/flush_cache", g.flush_cache), ("POST", "/flush_cache", g.flush_cache),
        ("GET", "/slow_down", g.slow_down), ("POST", "/slow_down", g.slow_down),
        ("GET", "/health", g.health), ("GET", "/ready", g.health),
        ("GET", "/health_generate", g.health_generate),
        ("GET", "/model_info", g.model_info), ("GET", "/get_model_info", g.model_info),
        ("GET", "/server_info", g.server_info), ("GET", "/get_server_info", g.server_info),
        ("POST", "/update_weights_from_disk", w.update_weights_from_disk),
        ("POST", "/init_weights_update_group", w.init_weights_update_group),
        ("POST", "/destroy_weights_update_group", w.destroy_weights_update_group),
        ("POST", "/update_weights_from_distributed", w.update_weights_from_distributed),
        ("POST", "/update_weight_version", w.update_weight_version),
        ("GET", "/get_weights_by_name", w.get_weights_by_name),
        ("POST", "/get_weights_by_name", w.get_weights_by_name),
    ]  # fmt: skip
    routes += OpenAIHandlers(state).routes()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return app


def _auth_middleware(api_key: str | None) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key is not None and not request.path.startswith(_OPEN_PATHS):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return auth


# Routes whose body SGLang validates with pydantic (FastAPI `Body()`): a body that breaks the schema gets
# its RequestValidationError answer (400, ErrorResponse) rather than /generate's contract error.
_VALIDATED_ROUTES: Final = frozenset(
    {"/abort_request", "/update_weights_from_disk", "/init_weights_update_group",
     "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weight_version"}
)  # fmt: skip


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await _unwrap_group(handler, request)
    except proto.BadRequest as exc:
        if exc.contract and request.path in _VALIDATED_ROUTES:
            return error_response(str(exc), 400, kind="Bad Request")
        return bad_request(exc)
    except RequestAborted as exc:
        # SGLang's _handle_abort_finish_reason: status 400 is a ValueError ({"error": {"message"}}), any
        # other an HTTPException (ErrorResponse with that status), e.g. 503 for the request timeouts.
        if exc.status_code == 400:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        return error_response(str(exc), exc.status_code)
    except EngineClosed as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=503)
    except web.HTTPException:
        raise  # aiohttp's own 404/405 answers
    except Exception as exc:  # a bug: answer JSON, log the traceback, keep serving
        _log.exception("engine.handler_failed", path=request.path)
        return web.json_response(
            {"error": {"message": f"internal error: {type(exc).__name__}: {exc}"}}, status=500
        )


async def _unwrap_group(handler: Handler, request: web.Request) -> web.StreamResponse:
    """Run `handler`; a request error raised inside a TaskGroup (a batch /generate) is raised bare."""
    try:
        return await handler(request)
    except ExceptionGroup as group:
        for kind in (proto.BadRequest, RequestAborted, EngineClosed):
            if (sub := group.subgroup(kind)) is not None:
                raise _first_leaf(sub) from group
        raise


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def stop_match_text(tokenizer: Tokenizer | None, ids: list[int]) -> str:
    """The text stop strings are matched against: special tokens kept, as SGLang does, so a stop string
    such as "<|im_end|>" matches (the response text follows `skip_special_tokens` separately)."""
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""

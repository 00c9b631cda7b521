"""A FAKE SGLang server (a stub for tests and benchmarks): SGLang's HTTP API with zero model work.

This is **not** an inference engine. It answers SGLang's native endpoints with SGLang's field names so the
client, router, fault and partial-rollout tests (and `benchmarks.client`) exercise real HTTP, and tests
script what it does per request:

* generation is arithmetic: output token i is `(last input id + 1 + i) % vocab_size`, its log prob is
  `-(token % 7 + 1) / 10`, its text is `f"{token} "`; so continuing `input_ids + produced` gives the same
  tokens as an uninterrupted request. `token_latency_s` spaces tokens out in time.
* pause/continue behave like SGLang's: paused servers hold new requests; `abort` mode aborts in-flight
  requests (their produced tokens come back with finish_reason abort); `retract`/`in_place` freeze them.
  Like SGLang, a cache flush is refused while requests hold KV (running, or frozen `in_place`; retracted
  ones hold none): `/flush_cache` answers 400 and an update asking for `flush_cache` (the default)
  answers 400 `success: false` after loading the weights.
  `/update_weight_version` defaults `abort_all_requests` to true, like SGLang. Tokens produced under
  different versions come back as `meta_info.weight_versions` spans.
* scripted misbehaviour of the control plane (attributes, or `/_stub/config`): `refuse_flushes` N (the
  next N `/flush_cache` answer 400 with SGLang's text, as while aborted requests still drain),
  `stale_loads` N (the next N `/update_weights_from_disk` answer success but change nothing: an engine
  that acknowledged and serves other weights), `legacy_weight_version` (`/model_info` without
  `weight_version`, which `/get_weight_version` serves instead, as older SGLang releases).
* faults, consumed one per request on their path (FIFO, `times` each): `status` (HTTP error), `garbage`
  (invalid JSON), `raw` (answer `body`, bytes or text, with `status`, default 200), `drop` (close the
  connection, no answer), `reset` (reset it), `delay` (then answer normally), `ok` (answer normally: keeps
  a script's place), `abort` (finish abort after `after_tokens`), `mutate` (`set`/`delete` dotted paths in
  the /generate answer; in-process, `apply`: a function of the answer, returning the answer to send, or
  bytes to send as they are), `cut` (the /generate answer's first half, then a reset). `clear_faults()`
  drops what is queued.
* like SGLang's http_server, `/generate` answers 400 to a body that SGLang's own schema
  (`sglang/api/v1/api_types.py`) rejects, when sglang is installed (`check_schema`, `--check-schema`).

Control endpoints (`/_stub/...`) work in-process and across processes: POST `/_stub/faults`
`{"faults": [...]}`, POST `/_stub/config` `{"token_latency_s", "healthy", "weight_version",
"refuse_flushes", "stale_loads", "legacy_weight_version"}`, GET
`/_stub/requests?path=/generate` (recorded bodies and routing headers), GET `/_stub/stats`.

Run as a process: `python -m miles_aio.testing.sglang_stub_server --port 0` prints one JSON line
`{"event": "ready", "host", "port", "pid"}` once listening, then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from aiohttp import web

from miles_aio.engine.spans import version_spans

__all__ = ["SGLangStubServer", "load_sglang_api_types", "main"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ROUTING_KEY_HEADER: Final = "X-SMG-Routing-Key"
_LISTEN_BACKLOG: Final = 4096


@dataclass(slots=True)
class _Req:
    """One in-flight /generate on the stub."""

    rid: str
    aborted: bool = False


@dataclass(slots=True)
class _Fault:
    kind: str
    times: int = 1
    spec: dict[str, Any] = field(default_factory=dict)


_BODY: Final[web.RequestKey[dict[str, Any]]] = web.RequestKey("body", dict)
_FAULT: Final = web.RequestKey("fault", _Fault)


def load_sglang_api_types() -> ModuleType | None:
    """SGLang's generated `/generate` schema (`sglang/api/v1/api_types.py`, msgspec only), loaded by file
    path because importing sglang pulls torch and CUDA packages; None without sglang installed."""
    spec = importlib.util.find_spec("sglang")
    path = Path(spec.origin).parent / "api" / "v1" / "api_types.py" if spec and spec.origin else None
    if path is None or not path.exists():
        return None
    name = "_miles_aio_sglang_api_types"
    if name not in sys.modules:
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            return None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module  # msgspec resolves the schema's forward references through sys.modules
        mod_spec.loader.exec_module(module)
    return sys.modules[name]


def _walk(obj: Any, dotted: str) -> tuple[Any, str | int]:
    keys: list[str | int] = [int(k) if k.lstrip("-").isdigit() else k for k in dotted.split(".")]
    for k in keys[:-1]:
        obj = obj[k]
    return obj, keys[-1]


class SGLangStubServer:
    """A fake SGLang HTTP server (aiohttp). Start it with `async with SGLangStubServer.open() as s:`."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        token_latency_s: float = 0.0,
        vocab_size: int = 1000,
        check_schema: bool = True,
    ) -> None:
        """`check_schema`: answer 400 to a `/generate` body SGLang's own schema rejects, as SGLang does
        (when sglang is installed; `pip install --no-deps sglang`)."""
        schema = load_sglang_api_types() if check_schema else None
        self._request_schema: Any = None if schema is None else schema.GenerateRequest
        self.api_key = api_key
        self.token_latency_s = token_latency_s
        self.vocab_size = vocab_size
        self.weight_version = "default"
        self.model_path = "stub-model"
        self.healthy = True
        self.disable_radix_cache = False  # SGLang's default; reported by /server_info
        self.refuse_flushes = 0
        self.stale_loads = 0
        self.legacy_weight_version = False
        self.counts: Counter[str] = Counter()
        self.requests: dict[str, deque[dict[str, Any]]] = {}
        self._faults: dict[str, deque[_Fault]] = {}
        self._inflight: dict[str, _Req] = {}
        self._paused = False
        self._pause_mode = ""
        self._cond = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.app = web.Application(middlewares=[self._middleware], client_max_size=256 * 1024**2)
        r = self.app.router
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)
        r.add_post("/abort_request", self._abort_request)
        r.add_post("/pause_generation", self._pause)
        r.add_post("/continue_generation", self._continue)
        r.add_route("*", "/flush_cache", self._flush_cache)
        r.add_post("/update_weights_from_disk", self._update_from_disk)
        r.add_post("/init_weights_update_group", self._ok)
        r.add_post("/destroy_weights_update_group", self._ok)
        r.add_post("/update_weights_from_distributed", self._update_from_distributed)
        r.add_post("/update_weight_version", self._update_weight_version)
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health)
        r.add_get("/model_info", self._model_info)
        r.add_get("/get_weight_version", self._get_weight_version)
        r.add_get("/server_info", self._server_info)
        r.add_post("/_stub/faults", self._stub_faults)
        r.add_post("/_stub/config", self._stub_config)
        r.add_get("/_stub/requests", self._stub_requests)
        r.add_get("/_stub/stats", self._stub_stats)

    # ---- lifecycle -----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        # handler_cancellation: a request whose client went away is cancelled, as SGLang aborts it.
        runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, shutdown_timeout=0.5, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=_LISTEN_BACKLOG, reuse_address=True)
        await site.start()
        self._runner = runner
        self.host, self.port = host, int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop listening and drop every connection (in-flight requests are aborted first)."""
        async with self._cond:
            for req in self._inflight.values():
                req.aborted = True
            self._cond.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
    ) -> AsyncIterator[SGLangStubServer]:
        server = cls(**kwargs)
        await server.start(host, port)
        try:
            yield server
        finally:
            await server.stop()

    @property
    def in_flight(self) -> int:
        """/generate requests being generated right now (not those held by a pause)."""
        return len(self._inflight)

    async def wait_in_flight(self, n: int) -> None:
        """Wait until at least `n` /generate requests are being generated."""
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._inflight) >= n)

    def add_faults(self, faults: list[dict[str, Any]]) -> None:
        """Queue faults (see the module docstring); each dict has `kind`, optional `path` and `times`."""
        for spec in faults:
            spec = dict(spec)
            path = spec.pop("path", "/generate")
            fault = _Fault(kind=spec.pop("kind"), times=int(spec.pop("times", 1)), spec=spec)
            self._faults.setdefault(path, deque()).append(fault)

    def clear_faults(self) -> None:
        """Drop every queued fault (a test's next script starts clean)."""
        self._faults.clear()

    def _next_fault(self, path: str) -> _Fault | None:
        queue = self._faults.get(path)
        if not queue:
            return None
        fault = queue[0]
        fault.times -= 1
        if fault.times <= 0:
            queue.popleft()
        return fault

    # ---- middleware: auth, recording, generic faults -------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith("/_stub/"):
            return await handler(request)
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        self.counts[path] += 1
        body: Any = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        log = self.requests.setdefault(path, deque(maxlen=10_000))
        log.append({"body": body, "routing_key": request.headers.get(ROUTING_KEY_HEADER)})
        request[_BODY] = body if isinstance(body, dict) else {}
        fault = self._next_fault(path)
        if fault is not None:
            if fault.kind == "status":
                status = int(fault.spec.get("status", 500))
                return web.json_response({"error": {"message": f"stub fault {status}"}}, status=status)
            if fault.kind == "garbage":
                return web.Response(body=b'{"text": "oops', content_type="application/json")
            if fault.kind == "raw":
                status, raw = int(fault.spec.get("status", 200)), fault.spec.get("body", b"")
                data = raw if isinstance(raw, bytes) else str(raw).encode()
                return web.Response(status=status, body=data, content_type="application/json")
            if fault.kind in ("drop", "reset"):
                if (transport := request.transport) is not None and fault.kind == "drop":
                    transport.close()
                elif transport is not None:
                    transport.abort()
                return web.Response()
            if fault.kind == "delay":
                await asyncio.sleep(float(fault.spec.get("delay_s", 1.0)))
            else:
                request[_FAULT] = fault
        return await handler(request)

    # ---- /generate -----------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """One prompt, or SGLang's batch form (list-valued `input_ids`, with a list or one object of
        `sampling_params` and a list of `rid`s): a list of answers in order. A fault applies to the whole
        request: `abort` to every item, `mutate` to every item's answer, `cut` to the whole body."""
        body: dict[str, Any] = request[_BODY]
        if self._request_schema is not None:
            try:
                self._request_schema.from_json_value(body)
            except ValueError as e:  # JsonContractError: SGLang's http_server answers 400 {"error": ...}
                return web.json_response({"error": str(e)}, status=400)
        fault: _Fault | None = request.get(_FAULT)
        ids = body["input_ids"]
        if not (ids and isinstance(ids[0], list)):
            out = await self._generate_one(body, fault)
            if isinstance(out, bytes):
                return web.Response(body=out, content_type="application/json")
            return await self._answer(request, out, fault)
        raw_params, rids = body.get("sampling_params"), body.get("rid")
        items = [
            {
                **body,
                "input_ids": item_ids,
                "sampling_params": raw_params[i] if isinstance(raw_params, list) else raw_params,
                "rid": rids[i] if isinstance(rids, list) else None,
            }
            for i, item_ids in enumerate(ids)
        ]
        outs = await asyncio.gather(*(self._generate_one(item, fault) for item in items))
        answers = [json.loads(out) if isinstance(out, bytes) else out for out in outs]
        return await self._answer(request, answers, fault)

    async def _answer(self, request: web.Request, out: Any, fault: _Fault | None) -> web.StreamResponse:
        if fault is not None and fault.kind == "cut":
            return await _cut(request, json.dumps(out).encode())
        return web.json_response(out)

    async def _generate_one(self, body: dict[str, Any], fault: _Fault | None) -> Any:
        """One prompt's answer: a JSON value, or bytes from a `mutate` fault's `apply`."""
        input_ids: list[int] = body["input_ids"]
        params: dict[str, Any] = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        stop_ids = set(params.get("stop_token_ids") or ())
        abort_after = int(fault.spec.get("after_tokens", 0)) if fault and fault.kind == "abort" else None
        rid = str(body.get("rid") or os.urandom(8).hex())
        start = time.monotonic()
        async with self._cond:  # like SGLang: a paused server holds new requests
            await self._cond.wait_for(lambda: not self._paused)
        async with self._cond:
            req = self._inflight[rid] = _Req(rid)
            self._cond.notify_all()
        tokens: list[int] = []
        versions: list[str] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        last = input_ids[-1] if input_ids else 0
        try:
            while len(tokens) < max_new:
                if self.token_latency_s > 0 or self._paused:
                    await self._step(req)
                if req.aborted or (abort_after is not None and len(tokens) >= abort_after):
                    finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": 200}
                    break
                tok = (last + 1 + len(tokens)) % self.vocab_size
                tokens.append(tok)
                versions.append(self.weight_version)
                if tok in stop_ids:
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            del self._inflight[rid]
            async with self._cond:
                self._cond.notify_all()
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - start,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-(t % 7 + 1) / 10, t, None] for t in tokens]
        if len(set(versions)) > 1:
            meta["weight_versions"] = version_spans(versions, current=self.weight_version)
        out: dict[str, Any] = {
            "text": "".join(f"{t} " for t in tokens),
            "output_ids": tokens,
            "meta_info": meta,
        }
        if fault is not None and fault.kind == "mutate":
            for dotted, value in fault.spec.get("set", {}).items():
                obj, key = _walk(out, dotted)
                obj[key] = value
            for dotted in fault.spec.get("delete", []):
                obj, key = _walk(out, dotted)
                del obj[key]
            if (apply := fault.spec.get("apply")) is not None:
                return apply(out)
        return out

    async def _step(self, req: _Req) -> None:
        """One simulated decode step: waits `token_latency_s` (cut short by an abort), then, while the
        server is paused in retract/in_place mode, until continue or abort."""
        async with self._cond:
            if self.token_latency_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.token_latency_s):
                        await self._cond.wait_for(lambda: req.aborted)
            await self._cond.wait_for(lambda: req.aborted or not self._paused)

    async def _abort(self, rid: str | None) -> None:
        async with self._cond:
            for req in self._inflight.values():
                if rid is None or req.rid == rid:
                    req.aborted = True
            self._cond.notify_all()
            await self._cond.wait_for(
                lambda: not self._inflight if rid is None else rid not in self._inflight
            )

    # ---- control plane -------------------------------------------------------------------------------

    async def _abort_request(self, request: web.Request) -> web.StreamResponse:
        body = request[_BODY]
        await self._abort(None if body.get("abort_all") else str(body.get("rid", "")))
        return web.Response()

    async def _pause(self, request: web.Request) -> web.StreamResponse:
        mode = request[_BODY].get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": {"message": f"bad mode {mode!r}"}}, status=400)
        async with self._cond:
            self._paused, self._pause_mode = True, mode
        if mode == "abort":
            await self._abort(None)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.StreamResponse:
        async with self._cond:
            self._paused = False
            self._cond.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _holds_kv(self) -> bool:
        """Some request holds KV: it runs, or it is frozen in place (retracted requests hold none)."""
        return bool(self._inflight) and not (self._paused and self._pause_mode == "retract")

    async def _flush_cache(self, request: web.Request) -> web.StreamResponse:
        if self.refuse_flushes > 0:
            self.refuse_flushes -= 1
            return web.Response(status=400, text="Cache not flushed: requests are running or queued.\n")
        if self._holds_kv():
            return web.Response(status=400, text="Cache not flushed: requests are running or queued.\n")
        return web.Response(text="Cache flushed.\n")

    def _updated(self, body: dict[str, Any]) -> web.StreamResponse:
        """SGLang's answer after a weight update: it fails the call if the flush it asked for is refused."""
        if body.get("flush_cache", True) and self._holds_kv():
            message = "Weights were updated, but the cache was not flushed because requests are still running"
            return web.json_response({"success": False, "message": message}, status=400)
        return web.json_response({"success": True, "message": "Succeeded.", "num_paused_requests": 0})

    async def _update_from_disk(self, request: web.Request) -> web.StreamResponse:
        body = request[_BODY]
        if body.get("abort_all_requests"):
            await self._abort(None)
        if self.stale_loads > 0:  # acknowledged, nothing loaded
            self.stale_loads -= 1
            return web.json_response({"success": True, "message": "Succeeded.", "num_paused_requests": 0})
        self.model_path = body["model_path"]
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return self._updated(body)

    async def _update_from_distributed(self, request: web.Request) -> web.StreamResponse:
        body = request[_BODY]
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return self._updated(body)

    async def _update_weight_version(self, request: web.Request) -> web.StreamResponse:
        body = request[_BODY]
        if body.get("abort_all_requests", True):  # SGLang's default: kills in-flight generation
            await self._abort(None)
        self.weight_version = body["new_version"]
        new = body["new_version"]
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

    async def _ok(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"success": True, "message": "Succeeded."})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.healthy else 503)

    async def _model_info(self, request: web.Request) -> web.StreamResponse:
        info = {"model_path": self.model_path, "served_model_name": "stub", "is_generation": True,
                "tokenizer_path": self.model_path, "preferred_sampling_params": None}  # fmt: skip
        if not self.legacy_weight_version:
            info["weight_version"] = self.weight_version
        return web.json_response(info)

    async def _get_weight_version(self, request: web.Request) -> web.StreamResponse:
        if not self.legacy_weight_version:  # gone from SGLang since /model_info carries it
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"weight_version": self.weight_version})

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"model_path": self.model_path, "host": self.host, "port": self.port,
                                  "disable_radix_cache": self.disable_radix_cache,
                                  "version": "stub", "internal_states": [{}], "stub": True})  # fmt: skip

    # ---- scripting -----------------------------------------------------------------------------------

    async def _stub_faults(self, request: web.Request) -> web.StreamResponse:
        self.add_faults((await request.json())["faults"])
        return web.json_response({"ok": True})

    async def _stub_config(self, request: web.Request) -> web.StreamResponse:
        cfg = await request.json()
        self.token_latency_s = float(cfg.get("token_latency_s", self.token_latency_s))
        self.healthy = bool(cfg.get("healthy", self.healthy))
        self.weight_version = str(cfg.get("weight_version", self.weight_version))
        self.refuse_flushes = int(cfg.get("refuse_flushes", self.refuse_flushes))
        self.stale_loads = int(cfg.get("stale_loads", self.stale_loads))
        self.legacy_weight_version = bool(cfg.get("legacy_weight_version", self.legacy_weight_version))
        return web.json_response({"ok": True})

    async def _stub_requests(self, request: web.Request) -> web.StreamResponse:
        path = request.query.get("path", "/generate")
        return web.json_response(list(self.requests.get(path, ())))

    async def _stub_stats(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "counts": dict(self.counts),
                "in_flight": len(self._inflight),
                "paused": self._paused,
                "weight_version": self.weight_version,
            }
        )


async def _cut(request: web.Request, data: bytes) -> web.StreamResponse:
    """Send the headers (with the whole length) and the first half of `data`, then reset the connection."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = len(data)
    await resp.prepare(request)
    await resp.write(data[: len(data) // 2])
    if request.transport is not None:
        request.transport.abort()
    return resp


async def _serve(args: argparse.Namespace) -> None:
    server = SGLangStubServer(
        api_key=args.api_key, token_latency_s=args.token_latency_s, check_schema=args.check_schema
    )
    await server.start(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"event": "ready", "host": server.host, "port": server.port, "pid": os.getpid()}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    await stop.wait()  # unblocked by SIGTERM/SIGINT
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m miles_aio.testing.sglang_stub_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--token-latency-s", type=float, default=0.0)
    parser.add_argument(
        "--check-schema",
        action="store_true",
        help="reject /generate bodies SGLang's schema rejects (400), as SGLang does",
    )
    args = parser.parse_args(argv)
    with contextlib.suppress(ValueError, OSError):  # 1024 in-flight connections need > 1024 descriptors
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()

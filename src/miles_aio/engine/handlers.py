"""Generation, control and info routes: `/generate`, `/abort_request`, pause/continue, flush, health, info.

Each handler parses its body with `protocol`, calls the engine (never blocking the loop), and answers in
SGLang's shape; `BadRequest` raised anywhere becomes a 400 in the server's error middleware.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
import uuid
from typing import Any, Final

import msgspec
from aiohttp import web

from miles_aio import __version__
from miles_aio.engine import protocol as proto
from miles_aio.engine.core import LogprobOptions, Request, TokenLogprobs
from miles_aio.engine.sampling import SamplingParams
from miles_aio.engine.spans import version_spans
from miles_aio.engine.state import ServerState, read_body

__all__ = ["EMBEDDED_ENGINE", "SGLANG_API_VERSION", "GenerationHandlers"]

_HEALTH_TIMEOUT_S: Final = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
EMBEDDED_ENGINE: Final = "miles_aio-embedded"
"""`/server_info` `engine`: tells a client it talks to this engine, not to SGLang."""
SGLANG_API_VERSION: Final = "0.5.23"
"""The SGLang release whose HTTP API (field names, bodies, statuses) this engine follows."""
_RECENT_STEP_S: Final = 5.0
"""/health_generate answers 200 without generating if a step finished this recently."""


class GenerationHandlers:
    def __init__(self, state: ServerState) -> None:
        self.s = state
        self.engine = state.engine
        self._startup_time = time.time()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """`/generate`: one prompt, or a batch, each sampled n times; one JSON answer (a list for a batch
        or n > 1, in SGLang's order), or with `stream` an SSE stream of cumulative answers, each carrying
        `index` for a batch, ending in `data: [DONE]`. Every prompt is checked before any is queued."""
        req = proto.parse_generate(await read_body(request))
        reqs = [self._new_request(item) for item in req.items]
        if req.items[0].params.n > 1:
            await self._warm_prefixes(reqs)
        if req.stream:
            return await self._stream(request, req, reqs)
        async with asyncio.TaskGroup() as tg:
            for r in reqs:
                tg.create_task(self.engine.generate(r), name=f"generate-{r.rid}")
        if failed := [r for r in reqs if r.error is not None]:
            return web.json_response({"error": {"message": failed[0].error}}, status=500)
        out = [self._response(r, req, item) for r, item in zip(reqs, req.items, strict=True)]
        return _json(out if req.batch else out[0])

    async def _warm_prefixes(self, reqs: list[Request]) -> None:
        """Before n > 1 samples of a prompt, prefill it once so every sample starts from its cached KV
        (SGLang's tokenizer manager sends the same 0-token warm-up)."""
        prompts = {(tuple(r.prompt_ids), r.cache_namespace): r for r in reqs}
        async with asyncio.TaskGroup() as tg:
            for (ids, namespace), r in prompts.items():
                warm = self.engine.new_request(
                    rid=f"{r.rid}-prefix",
                    prompt_ids=list(ids),
                    params=SamplingParams(max_new_tokens=0),
                    cache_namespace=namespace,
                    prefill_only=True,
                )
                tg.create_task(self.engine.generate(warm), name=f"warm-{warm.rid}")

    def _new_request(self, item: proto.GenerateItem) -> Request:
        if item.input_ids is not None:
            prompt = item.input_ids
        elif self.s.tokenizer is None:
            raise proto.BadRequest("text input needs a tokenizer.json in the model dir; send input_ids")
        else:
            prompt = self.s.tokenizer.encode(item.text or "").ids
            if not prompt:
                raise proto.BadRequest("the text encodes to no tokens")
        logprobs = LogprobOptions(
            start_len=item.logprob_start_len if item.return_logprob and item.logprob_start_len >= 0 else None,
            top_n=item.top_logprobs_num if item.return_logprob else 0,
            token_ids=item.token_ids_logprob if item.return_logprob else (),
        )
        return self.engine.new_request(
            rid=item.rid or uuid.uuid4().hex,
            prompt_ids=prompt,
            params=item.params,
            logprobs=logprobs,
            cache_namespace=item.cache_namespace,
        )

    async def _stream(
        self, request: web.Request, req: proto.GenerateReq, reqs: list[Request]
    ) -> web.StreamResponse:
        """SSE: one `data:` chunk per request and step that grew it (SGLang's non-incremental chunks:
        the text and output ids so far), then `data: [DONE]`. A client that goes away aborts the rest."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def pump(index: int, r: Request, item: proto.GenerateItem) -> None:
            async for _ in self.engine.stream(r):
                out = self._response(r, req, item)
                if req.batch:
                    out["index"] = index
                if r.error is not None:
                    out = {"error": {"message": r.error, "type": "internal_error", "code": 500}}
                await chunks.put(b"data: " + msgspec.json.encode(out) + b"\n\n")

        async def pump_all() -> None:
            async with asyncio.TaskGroup() as tg:
                for i, (r, item) in enumerate(zip(reqs, req.items, strict=True)):
                    tg.create_task(pump(i, r, item), name=f"stream-{r.rid}")
            await chunks.put(None)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(pump_all(), name="stream-pumps")
            while (chunk := await chunks.get()) is not None:
                await resp.write(chunk)  # a vanished client raises here: the TaskGroup aborts the pumps
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _response(self, r: Request, req: proto.GenerateReq, item: proto.GenerateItem) -> dict[str, Any]:
        text = self.s.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        if (
            r.matched_stop is not None
            and not r.params.no_stop_trim
            and (cut := text.find(r.matched_stop)) >= 0
        ):
            text = text[:cut]
        spans = version_spans(r.output_versions, current=self.engine.weight_version)
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "num_retractions": r.num_retractions,
            "e2e_latency": time.monotonic() - r.created_s,
        }
        if item.return_logprob:
            self._add_logprobs(meta, r, req.return_text_in_logprobs)
        out: dict[str, Any] = {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}
        if req.return_prompt_token_ids:
            out["prompt_token_ids"] = r.prompt_ids
        return out

    def _add_logprobs(self, meta: dict[str, Any], r: Request, with_text: bool) -> None:
        """SGLang's `add_logprob_to_meta_info`: [logprob, token id, text or None] triples; top-n and
        token-id lists per position (None where a position has none: the first prompt token)."""
        n_out = len(r.output_ids)
        start = r.logprobs.start_len
        in_ids = r.prompt_ids[start:] if start is not None else []
        meta["input_token_logprobs"] = self._triples(r.input_logprobs, in_ids, with_text)
        meta["output_token_logprobs"] = self._triples(r.output_logprobs[:n_out], r.output_ids, with_text)
        meta["output_token_logprobs_length"] = n_out
        if r.logprobs.top_n > 0:
            meta["input_top_logprobs"] = [self._pairs(p, with_text) for p in r.input_top_logprobs]
            meta["output_top_logprobs"] = [self._pairs(p, with_text) for p in r.output_top_logprobs[:n_out]]
        if r.logprobs.token_ids:
            meta["input_token_ids_logprobs"] = [self._pairs(p, with_text) for p in r.input_token_ids_logprobs]
            meta["output_token_ids_logprobs"] = [
                self._pairs(p, with_text) for p in r.output_token_ids_logprobs[:n_out]
            ]

    def _triples(self, logprobs: list[Any], ids: list[int], with_text: bool) -> list[list[Any]]:
        texts = [self._token_text(t) for t in ids] if with_text else [None] * len(ids)
        return [list(e) for e in zip(logprobs, ids, texts, strict=True)]

    def _pairs(self, pairs: TokenLogprobs | None, with_text: bool) -> list[list[Any]] | None:
        if pairs is None:
            return None
        return [[lp, t, self._token_text(t) if with_text else None] for lp, t in pairs]

    def _token_text(self, token: int) -> str:
        return self.s.decode([token], skip_special_tokens=False)

    async def abort_request(self, request: web.Request) -> web.Response:
        req = proto.parse_abort(await read_body(request))
        if req.rid or req.abort_all:  # SGLang ignores an empty rid without abort_all
            self.engine.abort(rid=req.rid, abort_all=req.abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        await self.engine.pause(proto.parse_pause(await read_body(request)).mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_body(request)  # torch_empty_cache: nothing to empty on CPU
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n")
        return web.Response(
            text="Cache not flushed: requests are running (pause with retract, or wait).\n", status=400
        )

    async def slow_down(self, request: web.Request) -> web.Response:
        self.engine.forward_sleep_s = proto.parse_slow_down(await read_body(request))
        return web.json_response({"success": True})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.closed else 200)  # 503 while shutting down, as SGLang

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 if the engine can generate: it is paused (nothing to test) or just produced a token, or a
        1-token greedy request succeeds within SGLang's 20 s; 503 otherwise."""
        engine = self.engine
        if engine.paused or time.monotonic() - engine.last_step_end_s < _RECENT_STEP_S:
            return web.Response(status=200)
        params = proto.parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0})
        r = engine.new_request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[0], params=params)
        try:
            async with asyncio.timeout(_HEALTH_TIMEOUT_S):
                r = await engine.generate(r)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200 if r.error is None else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        spec = self.s.model.spec
        return web.json_response(
            {
                "model_path": str(self.s.model_path),
                "served_model_name": self.s.cfg.served_model_name or str(self.s.cfg.model_path),
                "tokenizer_path": str(self.s.cfg.model_path),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": spec.model_type,
                "architectures": list(spec.architectures),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's `/server_info`: its resolved server args (those this engine has, SGLang's names and
        values), its scheduler info, `internal_states` (one per DP rank: here one), `version`; plus the
        marker `engine` (and this engine's own fields). `version` is miles_aio's (PEP 440), not SGLang's:
        clients gating on SGLang versions read `sglang_api_version`, the SGLang the wire API follows."""
        cfg, engine = self.s.cfg, self.engine
        limits = cfg.request_timeouts
        args: dict[str, Any] = {
            "model_path": str(cfg.model_path),  # the startup one, as SGLang (/model_info: the live one)
            "tokenizer_path": str(cfg.model_path),
            "served_model_name": cfg.served_model_name or str(cfg.model_path),
            "skip_tokenizer_init": self.s.tokenizer is None,
            "load_format": "auto",
            "dtype": str(self.s.model.dtype).removeprefix("torch."),
            "kv_cache_dtype": "auto",
            "device": "cpu",
            "host": cfg.host,
            "port": self.s.port,
            "context_length": engine.context_len,
            "max_running_requests": engine.max_running,
            "max_total_tokens": None,
            "page_size": 1,
            "chunked_prefill_size": -1,  # prompts prefill whole
            "schedule_policy": "fcfs",
            "disable_radix_cache": cfg.prefix_cache_entries == 0,
            "random_seed": cfg.seed,
            "weight_version": cfg.weight_version,  # the startup one, as SGLang's server args
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "enable_dp_attention": False,
            "disaggregation_mode": "null",
            "stream_interval": 1,
            "incremental_streaming_output": False,
            "watchdog_timeout": cfg.watchdog_timeout,
            "soft_watchdog_timeout": cfg.soft_watchdog_timeout,
            "api_key_set": cfg.api_key is not None,  # SGLang lists api_key itself; never echoed here
        }
        internal = {
            **args,
            "weight_version": engine.weight_version,  # live, as SGLang's resolved args with overrides
            "world_size": 1,
            "startup_time": self._startup_time,
            "effective_max_running_requests_per_dp": engine.max_running,
            **engine.internal_state(),
        }
        return web.json_response(
            {
                **args,
                "launch_command": shlex.join(sys.orig_argv),
                "status": "ready",
                "max_total_num_tokens": engine.max_running * engine.context_len,
                "max_req_input_len": engine.context_len - 1,
                "kv_events": None,
                "startup_time": self._startup_time,
                "internal_states": [internal],
                "version": __version__,
                "frontend": "python",
                "engine": EMBEDDED_ENGINE,
                "sglang_api_version": SGLANG_API_VERSION,
                "rollout_backend": "local",
                "pid": os.getpid(),
                "max_context_length": engine.context_len,
                "weights_root": str(self.s.weights_root),
                "num_threads": cfg.num_threads,
                "prefix_cache_entries": cfg.prefix_cache_entries,
                "request_timeouts": {
                    "SGLANG_REQ_WAITING_TIMEOUT": limits.waiting_s,
                    "SGLANG_REQ_RUNNING_TIMEOUT": limits.running_s,
                },
            }
        )


def _json(body: object) -> web.Response:
    """A JSON answer encoded by msgspec: several times faster than `json.dumps` for /generate's long
    token and logprob lists, which the event loop encodes between engine steps."""
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")

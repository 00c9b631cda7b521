"""Generation, control and info routes: `/generate`, `/abort_request`, pause/continue, flush, health, info.

Each handler parses its body with `protocol`, calls the engine (never blocking the loop), and answers in
SGLang's shape; `BadRequest` raised anywhere becomes a 400 in the server's error middleware.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, Final

from aiohttp import web

from miles_aio.engine import protocol as proto
from miles_aio.engine.core import Request
from miles_aio.engine.state import ServerState, read_body

__all__ = ["GenerationHandlers"]

_HEALTH_TIMEOUT_S: Final = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
_RECENT_STEP_S: Final = 5.0
"""/health_generate answers 200 without generating if a step finished this recently."""


class GenerationHandlers:
    def __init__(self, state: ServerState) -> None:
        self.s = state
        self.engine = state.engine

    async def generate(self, request: web.Request) -> web.Response:
        req = proto.parse_generate(await read_body(request))
        if req.input_ids is not None:
            prompt = req.input_ids
        elif self.s.tokenizer is None:
            raise proto.BadRequest("text input needs a tokenizer.json in the model dir; send input_ids")
        else:
            prompt = self.s.tokenizer.encode(req.text or "").ids
            if not prompt:
                raise proto.BadRequest("the text encodes to no tokens")
        r = self.engine.new_request(rid=req.rid or uuid.uuid4().hex, prompt_ids=prompt, params=req.params)
        r = await self.engine.generate(r)
        if r.error is not None:
            return web.json_response({"error": {"message": r.error}}, status=500)
        return web.json_response(self._response(r, req))

    def _response(self, r: Request, req: proto.GenerateReq) -> dict[str, Any]:
        text = self.s.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        if (
            r.matched_stop is not None
            and not r.params.no_stop_trim
            and (cut := text.find(r.matched_stop)) >= 0
        ):
            text = text[:cut]
        spans = _version_spans(r.output_versions, current=self.engine.weight_version)
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
        if req.return_logprob:
            texts: list[str | None] = (
                [self.s.decode([t], skip_special_tokens=False) for t in r.output_ids]
                if req.return_text_in_logprobs
                else [None] * len(r.output_ids)
            )
            meta["output_token_logprobs"] = [
                list(e) for e in zip(r.output_logprobs, r.output_ids, texts, strict=True)
            ]
        out: dict[str, Any] = {"text": text, "output_ids": r.output_ids, "meta_info": meta}
        if req.return_prompt_token_ids:
            out["prompt_token_ids"] = r.prompt_ids
        return out

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
        cfg = self.s.cfg
        return web.json_response(
            {
                "model_path": str(self.s.model_path),
                "served_model_name": cfg.served_model_name or str(cfg.model_path),
                "tokenizer_path": str(cfg.model_path),
                "host": cfg.host,
                "port": self.s.port,
                "pid": os.getpid(),
                "max_context_length": self.engine.context_len,
                "context_length": self.engine.context_len,
                "max_running_requests": self.engine.max_running,
                "max_total_num_tokens": self.engine.max_running * self.engine.context_len,
                "weights_root": str(self.s.weights_root),
                "api_key_set": cfg.api_key is not None,
                "num_threads": cfg.num_threads,
                "random_seed": cfg.seed,
                "weight_version": self.engine.weight_version,
                "internal_states": [self.engine.internal_state()],
                "version": "miles_aio-local-engine",
                "rollout_backend": "local",
            }
        )


def _version_spans(versions: list[str], *, current: str) -> list[dict[str, Any]]:
    """Per-token versions → SGLang's `weight_versions`: `[{version, start, end}]`, end exclusive, covering
    every output token; a request with no output gets one empty span at the current version."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans

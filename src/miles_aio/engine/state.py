"""What the HTTP handlers share: the server's configuration and its live state, plus reply helpers."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from aiohttp import web
from tokenizers import Tokenizer

from miles_aio.chat_template import ChatTemplate
from miles_aio.engine import protocol as proto
from miles_aio.engine.core import LocalEngine
from miles_aio.engine.model import LlamaModel
from miles_aio.engine.timeouts import DEFAULT_WATCHDOG_TIMEOUT_S, Limits

__all__ = ["ServerConfig", "ServerState", "bad_request", "error_response", "read_body", "weight_reply"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """One engine server's settings (the CLI flags of the same names; `cli.py` validates them)."""

    model_path: Path
    """HF Llama dir: config.json, *.safetensors, tokenizer.json."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port; the ready line reports the one bound."""
    api_key: str | None = None
    """When set, every route but /health*, /ready needs `Authorization: Bearer <api_key>`."""
    weights_root: Path | None = None
    """update_weights_from_disk reads only under this dir; None means the parent of model_path."""
    max_running_requests: int = 64
    """Requests decoded together (one KV slot each); more wait in the queue."""
    context_length: int | None = None
    """Max prompt + output tokens; None means the model's max_position_embeddings."""
    num_threads: int = 1
    """torch intra-op threads of the compute thread."""
    seed: int = 0
    """Seeds the per-request generators of requests without a sampling_seed."""
    weight_version: str = "default"
    """The version label before any update (SGLang's default)."""
    prefix_cache_entries: int = 64
    """Prompts whose KV is kept for reuse (LRU); 0 disables the prefix cache."""
    served_model_name: str | None = None
    watchdog_timeout: float | None = DEFAULT_WATCHDOG_TIMEOUT_S
    """SGLang's `--watchdog-timeout`: no forward for this long while requests are in the running batch
    kills the server (see `timeouts`); None: off."""
    soft_watchdog_timeout: float | None = None
    """SGLang's `--soft-watchdog-timeout`: the same, but it only logs and dumps stacks."""
    request_timeouts: Limits = field(default_factory=Limits)
    """`SGLANG_REQ_WAITING_TIMEOUT` / `SGLANG_REQ_RUNNING_TIMEOUT`, read once at start (`cli.py`)."""
    exit_on_stdin_eof: bool = False
    """Shut down when stdin reaches EOF (set by the launcher, whose pipe closes when it dies)."""


@dataclass(kw_only=True)
class ServerState:
    """What the handlers share. Lives on the event loop; `model` tensors are touched only via `executor`."""

    cfg: ServerConfig
    engine: LocalEngine
    model: LlamaModel
    executor: ThreadPoolExecutor
    tokenizer: Tokenizer | None
    model_path: Path
    weights_root: Path
    chat_template: ChatTemplate | None = None
    """The model's chat template (loaded once at start); None: chat completions answer 400."""
    port: int = 0
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    dist_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if self.tokenizer else ""


def bad_request(exc: proto.BadRequest) -> web.Response:
    body: dict[str, Any] = {"error": str(exc)} if exc.contract else {"error": {"message": str(exc)}}
    return web.json_response(body, status=400)


def error_response(message: str, status: int, *, kind: str | None = None) -> web.Response:
    """SGLang's `ErrorResponse` body, `{"object": "error", "message", "type", "param", "code"}`: what its
    HTTPException handler (type: the status, e.g. "503") and its RequestValidationError handler (type:
    "Bad Request", status 400) answer."""
    body = {"object": "error", "message": message, "type": kind or str(status), "param": None, "code": status}
    return web.json_response(body, status=status)


def weight_reply(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response(
        {"success": success, "message": message, **extra}, status=200 if success else 400
    )


async def read_body(request: web.Request) -> object:
    """The JSON body ({} when empty); a body that is not JSON is a contract error."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise proto.BadRequest(f"request body is not valid JSON: {exc}", contract=True) from exc

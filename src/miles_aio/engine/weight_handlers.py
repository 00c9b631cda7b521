"""Weight routes: `/update_weights_from_disk`, `/init_weights_update_group`, `/destroy_weights_update_group`,
`/update_weights_from_distributed`, `/update_weight_version`, `/get_weights_by_name`.

Each update is read (from disk, or by broadcast from trainer rank 0), validated whole by
`weights.stage_update`, and only then handed to `LocalEngine.update_weights`, which swaps it in between
steps. Answers are SGLang's `{"success", "message", ...}`, 200 or 400.

Cancellation (the server runs with `handler_cancellation`, so a client that hangs up cancels its handler):
a torch.distributed call in a thread cannot be stopped, so a cancelled handler still waits for it
(`finish_even_if_cancelled`) before the cancellation propagates: a receive keeps `dist_lock` until its
collective is done (a retry never starts a second collective on the group meanwhile), and a group whose
rendezvous completes after its request was cancelled is still registered (so
`destroy_weights_update_group` and shutdown can free it).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import structlog
import torch
from aiohttp import web

from miles_aio import weight_broadcast as weight_sync
from miles_aio._aio import finish_even_if_cancelled
from miles_aio.engine import protocol as proto
from miles_aio.engine.state import ServerState, read_body, weight_reply
from miles_aio.engine.weights import (
    WeightUpdateError,
    parse_dtype,
    read_checkpoint,
    resolve_weights_dir,
    stage_update,
)

__all__ = ["WeightHandlers"]

_log = structlog.get_logger(__name__)


class WeightHandlers:
    def __init__(self, state: ServerState) -> None:
        self.s = state
        self.engine = state.engine
        self._joining: set[str] = set()
        """Group names whose rendezvous is under way (not yet in `state.groups`)."""

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        req = _parse(proto.parse_update_from_disk, body, "Failed to update weights: ", num_paused_requests=0)
        if isinstance(req, web.Response):
            return req
        if req.abort_all_requests:  # SGLang aborts first, before reading the checkpoint
            self.engine.abort(abort_all=True)
        try:
            path = resolve_weights_dir(req.model_path, weights_root=self.s.weights_root)
            staged = await asyncio.to_thread(self._stage_from_disk, path)
        except (WeightUpdateError, OSError) as exc:
            return weight_reply(False, f"Failed to update weights: {exc}", num_paused_requests=0)
        n_paused, flushed = await self.engine.update_weights(
            staged, weight_version=req.weight_version, flush_cache=req.flush_cache
        )
        self.s.model_path = path
        if not flushed:
            return weight_reply(False, _CACHE_NOT_FLUSHED, num_paused_requests=n_paused)
        return weight_reply(
            True,
            _with_version("Succeeded to update model weights.", req.weight_version),
            num_paused_requests=n_paused,
        )

    def _stage_from_disk(self, path: Path) -> dict[str, torch.Tensor]:
        return stage_update(
            self.s.model.spec,
            read_checkpoint(path, weights_root=self.s.weights_root),
            dtype=self.s.model.dtype,
            require_all=True,
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = _parse(proto.parse_init_group, await read_body(request), "")
        if isinstance(req, web.Response):
            return req
        name = req.group_name
        if name in self.s.groups:
            return weight_reply(False, f"group {name!r} already exists; destroy it first")
        if name in self._joining:
            return weight_reply(False, f"group {name!r} is being initialized by another request")

        async def join_and_register() -> None:
            # Blocks until every rank joined: off the loop. The engine is rank_offset + tp_rank (tp = 1).
            pg = await asyncio.to_thread(
                weight_sync.init_custom_process_group,
                backend=req.backend,
                master_address=req.master_address,
                master_port=req.master_port,
                world_size=req.world_size,
                rank=req.rank_offset,
                group_name=name,
            )
            self.s.groups[name] = pg  # here, not in the handler: registered even if the handler is cancelled

        self._joining.add(name)
        try:
            await finish_even_if_cancelled(join_and_register())
        except Exception as exc:
            return weight_reply(False, f"Failed to initialize custom process group: {exc}.")
        finally:
            self._joining.discard(name)
        return weight_reply(True, "Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        pg = self.s.groups.pop(proto.parse_group_name(await read_body(request)), None)
        if pg is None:
            return weight_reply(False, "The group to be destroyed does not exist.")
        await asyncio.to_thread(weight_sync.destroy_process_group, pg)
        return weight_reply(True, "Succeeded to destroy custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = _parse(
            proto.parse_update_from_distributed,
            await read_body(request),
            "Failed to update parameter online: ",
        )
        if isinstance(req, web.Response):
            return req
        try:
            dtypes = [parse_dtype(d) for d in req.dtypes]
        except WeightUpdateError as exc:
            return weight_reply(False, f"Failed to update parameter online: {exc}")
        pg = self.s.groups.get(req.group_name)
        if pg is None:
            known = sorted(self.s.groups)
            return weight_reply(
                False,
                f"Failed to receive weights: Group {req.group_name} not in {known}. "
                "Please call `init_weights_update_group` first.",
            )
        if req.abort_all_requests:  # SGLang aborts first, before receiving
            self.engine.abort(abort_all=True)
        receive = functools.partial(
            weight_sync.receive_flattened_bucket if req.flattened_bucket else weight_sync.receive_weights,
            shapes=req.shapes,
            dtypes=dtypes,
            group=pg,
        )
        if req.flattened_bucket:
            receive = functools.partial(receive, names=req.names)
        try:
            async with self.s.dist_lock:  # collectives on one group must not interleave
                # Held until the receive is really over, even if this request is cancelled meanwhile.
                tensors = await finish_even_if_cancelled(asyncio.to_thread(receive))
        except Exception as exc:
            return weight_reply(False, f"Failed to receive weights: {exc}")
        if not req.load_target:  # selector "draft": SGLang loads into its draft runners, and there are none
            return weight_reply(
                True, _with_version("Succeeded to update parameter online.", req.weight_version)
            )
        try:
            # Received first (so rank 0's broadcast completes), validated second: a bad update is
            # refused whole and the served weights stay as they were.
            staged = stage_update(
                self.s.model.spec,
                dict(zip(req.names, tensors, strict=True)),
                dtype=self.s.model.dtype,
                require_all=False,
            )
        except WeightUpdateError as exc:
            return weight_reply(False, f"Failed to update parameter online: {exc}")
        _, flushed = await self.engine.update_weights(
            staged, weight_version=req.weight_version, flush_cache=req.flush_cache
        )
        if not flushed:
            return weight_reply(False, _CACHE_NOT_FLUSHED)
        return weight_reply(True, _with_version("Succeeded to update parameter online.", req.weight_version))

    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = _parse(
            proto.parse_update_version, await read_body(request), "Failed to update weight version: "
        )
        if isinstance(req, web.Response):
            return req
        if req.abort_all_requests:
            self.engine.abort(abort_all=True)
        self.engine.set_weight_version(req.new_version)
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version,
            }
        )

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await read_body(request) if request.can_read_body else dict(request.query)
        if not isinstance(body, dict) or not isinstance(name := body.get("name"), str):
            raise proto.BadRequest("missing field `name`", contract=True)
        truncate = body.get("truncate_size", 100)
        if isinstance(truncate, str) and truncate.isdecimal():  # from a GET query string
            truncate = int(truncate)
        if not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 0:
            raise proto.BadRequest(f"truncate_size must be a non-negative integer, got {truncate!r}")
        weights, spec = self.s.model.weights, self.s.model.spec
        key = "model.embed_tokens.weight" if name == "lm_head.weight" and spec.tie_word_embeddings else name
        if key not in weights:
            raise proto.BadRequest(f"Get parameter by name failed: no parameter {name!r}")
        # Read on the compute thread, so a concurrent weight copy is never seen half-done.
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(self.s.executor, lambda: weights[key][:truncate].float().tolist())
        return web.json_response(rows)


_CACHE_NOT_FLUSHED: Final = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
"""SGLang's `flush_cache_after_weight_update` answer: the new weights serve, the call fails (400)."""
_R = TypeVar("_R")


def _parse(parse: Callable[[object], _R], body: object, prefix: str, **extra: Any) -> _R | web.Response:
    """Parse a weight request. A body that breaks SGLang's schema raises (the error middleware answers it
    as SGLang's validation error); a request the engine refuses is answered here, `{"success": false}`."""
    try:
        return parse(body)
    except proto.BadRequest as exc:
        if exc.contract:
            raise
        return weight_reply(False, f"{prefix}{exc}", **extra)


def _with_version(message: str, version: str | None) -> str:
    """SGLang's tokenizer manager appends the version it stamped to a successful update's message."""
    return message if version is None else f"{message} Weight version updated to {version}."

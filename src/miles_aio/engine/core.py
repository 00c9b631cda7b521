"""`LocalEngine`: continuous batching, pause/continue, abort and weight swaps, all owned by one event loop.

The scheduler loop (`LocalEngine.run`, one task in the server's TaskGroup)

    consumes:      requests queued by `generate` (FIFO; retracted requests go back to the front) and
                   weight updates queued by `update_weights`
    produces:      one token per running request per step, stamped with the weight version current when
                   the step started; finished requests resolve their future
    waits for:     the compute thread (`run_in_executor`; torch releases the GIL, so HTTP stays live), or
                   `_wake` when there is nothing it may run (idle, paused, or a weight update draining)
    unblocked by:  `generate`, `resume`, `abort`, `update_weights`, `close`

Each step admits waiting requests into free KV slots (they prefill, one by one, reusing cached prompt KV),
then decodes every other running request as one padded batch; new requests therefore join between steps.

Pause modes (`/pause_generation`, SGLang semantics): `abort` finishes every request now with finish_reason
abort and the tokens produced so far; `retract` waits for the step in flight, drops the running requests'
KV and puts them back at the front of the queue (after `/continue_generation` they are re-prefilled, prompt
+ output so far, under the weights current then); `in_place` waits for the step in flight and freezes the
requests on their KV. While paused nothing is computed and new requests queue.

Weight updates mirror SGLang's lock: while paused they apply at once; otherwise requests that arrived
before the update finish first (later ones wait), then the weights swap between steps. Either way the swap
happens on the compute thread between steps, so a step never sees half-copied weights.

Every method here runs on the event loop; only `ModelRunner` methods run on the compute thread.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
import torch

from miles_aio.engine.protocol import BadRequest, PauseMode
from miles_aio.engine.runner import ModelRunner, PrefixCache, Row, StepPlan, StepResult
from miles_aio.engine.sampling import SamplingParams

__all__ = ["EngineClosed", "LocalEngine", "Request"]

_log = structlog.get_logger(__name__)
_STOP_TAIL_SLACK: Final = 2
"""Extra tokens decoded beyond the longest stop string when checking for it (a token is >= 1 char)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down; queued work was dropped."""


@dataclass(eq=False, kw_only=True)
class Request:
    """One /generate call's state. Owned by the engine; the HTTP layer only reads it once finished."""

    rid: str
    seq: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    future: asyncio.Future[None]
    created_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    """The weight version of the step that produced each output token."""
    slot: int | None = None
    prefilled: bool = False
    """The slot holds KV for every token but the last: the next step feeds only that one."""
    cached_tokens: int = 0
    num_retractions: int = 0
    finish_reason: dict[str, Any] | None = None
    matched_stop: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(eq=False, kw_only=True)
class _WeightOp:
    staged: dict[str, torch.Tensor]
    weight_version: str | None
    flush_cache: bool
    barrier_seq: int
    """Requests with seq < barrier_seq finish before an unpaused update applies; later ones wait."""
    future: asyncio.Future[int]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Planned:
    plan: StepPlan
    requests: list[Request]
    version: str
    epoch: int


class LocalEngine:
    """The scheduler state machine plus its loop. Construct, then run `run()` in a TaskGroup."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        executor: Executor,
        detokenize: Callable[[list[int]], str],
        context_len: int,
        weight_version: str,
        prefix_cache_entries: int,
        seed: int,
    ) -> None:
        self._runner = runner
        self._executor = executor
        self._detokenize = detokenize
        self._eos = frozenset(runner.model.spec.eos_token_ids)
        self._vocab = runner.model.spec.vocab_size
        self.context_len = context_len
        self.max_running = runner.kv.num_slots
        self.weight_version = weight_version
        self._epoch = 0
        self._cache = PrefixCache(prefix_cache_entries)
        self._seeds = torch.Generator().manual_seed(seed)
        self._seq = itertools.count()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._by_rid: dict[str, Request] = {}
        self._free_slots = list(range(self.max_running - 1, -1, -1))
        self._ops: deque[_WeightOp] = deque()
        self.paused: PauseMode | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while no step or weight copy is running on the compute thread
        self._idle.set()
        self._closed = False
        self.forward_sleep_s: float | None = None
        self.last_step_end_s = 0.0
        self.last_gen_throughput = 0.0

    # ---- requests ----

    def new_request(self, *, rid: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Validate against the model's limits (SGLang's wording) and build the request; BadRequest if not."""
        if rid in self._by_rid:
            raise BadRequest(f"a request with rid {rid!r} is already running")
        if bad := [t for t in prompt_ids if not 0 <= t < self._vocab]:
            raise BadRequest(f"token id {bad[0]} is out of range for vocab size {self._vocab}")
        n = len(prompt_ids)
        if n >= self.context_len:
            raise BadRequest(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        if n + params.max_new_tokens > self.context_len:
            raise BadRequest(
                "Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. "
                f"You requested a total of {n + params.max_new_tokens} tokens: {n} tokens from the input "
                f"messages and {params.max_new_tokens} tokens for the completion."
            )
        seed = params.sampling_seed
        if seed is None:  # one draw per request from the engine seed: batching never changes a request's RNG
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        return Request(
            rid=rid,
            seq=next(self._seq),
            prompt_ids=list(prompt_ids),
            params=params,
            generator=torch.Generator().manual_seed(seed),
            future=asyncio.get_running_loop().create_future(),
        )

    async def generate(self, req: Request) -> Request:
        """Queue `req` and wait until it finishes. Cancelling the caller aborts the request."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if req.params.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            return req
        self._by_rid[req.rid] = req
        self._waiting.append(req)
        self._wake.set()
        try:
            await req.future
        except asyncio.CancelledError:
            self._finish(req, _abort_reason("client disconnected"))
            self._drop_finished_waiting()
            raise
        return req

    def abort(
        self, *, rid: str = "", abort_all: bool = False, message: str = "Aborted by /abort_request"
    ) -> int:
        """Finish the targeted requests now, keeping what they produced; returns how many. Never blocks."""
        targets = list(self._by_rid.values()) if abort_all else [r for r in (self._by_rid.get(rid),) if r]
        for req in targets:
            self._finish(req, _abort_reason(message))
        self._drop_finished_waiting()
        self._wake.set()
        return len(targets)

    # ---- control ----

    async def pause(self, mode: PauseMode) -> None:
        """Stop computing; returns once no step is running (see the module docstring for the modes)."""
        self.paused = mode
        if mode == "abort":
            self.abort(abort_all=True, message="Aborted by /pause_generation (mode abort)")
        # Loop: an Event wakes its waiters even if it was cleared again before they ran (a weight copy may
        # have started). From the is_set() check to the end there is no await, so nothing can start.
        while not self._idle.is_set():
            await self._idle.wait()
        if self.paused != mode:
            return  # continued, or paused in another mode, while we waited: that call decides
        self._reap()
        if mode == "retract":
            retracted = [r for r in self._running if not r.finished]
            for req in retracted:
                self._release_slot(req)
                req.prefilled = False
                req.num_retractions += 1
            self._running = []
            self._waiting.extendleft(reversed(retracted))
        _log.info("engine.paused", mode=mode, running=len(self._running), waiting=len(self._waiting))

    def resume(self) -> None:
        self.paused = None
        self._wake.set()

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while a request holds KV, as SGLang's flush_cache."""
        busy = any(not r.finished for r in self._running) or (not self.paused and self._waiting)
        if busy:
            return False
        self._cache.clear()
        return True

    def set_weight_version(self, version: str) -> None:
        """Relabel: tokens produced from the next step on carry `version` (weights are unchanged)."""
        self.weight_version = version

    async def update_weights(
        self, staged: dict[str, torch.Tensor], *, weight_version: str | None, flush_cache: bool
    ) -> int:
        """Swap in validated tensors between steps; returns SGLang's `num_paused_requests`."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        op = _WeightOp(
            staged=staged,
            weight_version=weight_version,
            flush_cache=flush_cache,
            barrier_seq=next(self._seq),
            future=asyncio.get_running_loop().create_future(),
        )
        self._ops.append(op)
        self._wake.set()
        return await op.future

    def close(self) -> None:
        """Abort every request and fail queued weight updates; `run()` returns at its next wake-up."""
        self._closed = True
        self.abort(abort_all=True, message="Aborted: the engine is shutting down")
        while self._ops:
            op = self._ops.popleft()
            if not op.future.done():
                op.future.set_exception(EngineClosed("the engine shut down before the weight update applied"))
        self._wake.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def internal_state(self) -> dict[str, Any]:
        return {
            "num_running_reqs": sum(not r.finished for r in self._running),
            "num_waiting_reqs": len(self._waiting),
            "num_pending_weight_updates": len(self._ops),
            "paused": self.paused is not None,
            "pause_mode": self.paused,
            "weight_version": self.weight_version,
            "weights_epoch": self._epoch,
            "prefix_cache_entries": len(self._cache),
            "kv_cache_capacity_tokens": self._runner.kv.capacity,
            "max_running_requests": self.max_running,
            "context_length": self.context_len,
            "last_gen_throughput": self.last_gen_throughput,
        }

    # ---- the scheduler loop ----

    async def run(self) -> None:
        """The scheduler loop (see the module docstring). Returns after `close()`."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            if (op := self._ready_op()) is not None:
                await self._apply_op(op, loop)
                continue
            planned = self._plan()
            if planned is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            try:
                result = await loop.run_in_executor(self._executor, self._runner.step, planned.plan)
            except Exception as exc:  # a bug in the forward: fail this step's requests, keep serving
                _log.exception("engine.step_failed")
                for req in planned.requests:
                    req.error = f"{type(exc).__name__}: {exc}"
                    self._finish(req, _abort_reason(f"internal error: {req.error}"))
            else:
                self._apply(planned, result)
            finally:
                self._idle.set()
                self._reap()
            if self.forward_sleep_s:  # SGLang's /slow_down test hook: a slower "forward", not holding the KV
                await asyncio.sleep(self.forward_sleep_s)

    def _ready_op(self) -> _WeightOp | None:
        if not self._ops:
            return None
        barrier = self._ops[0].barrier_seq
        drained = not any(r.seq < barrier for r in (*self._running, *self._waiting) if not r.finished)
        return self._ops.popleft() if self.paused or drained else None

    async def _apply_op(self, op: _WeightOp, loop: asyncio.AbstractEventLoop) -> None:
        num_paused = sum(not r.finished for r in (*self._running, *self._waiting)) if self.paused else 0
        self._idle.clear()
        try:
            await loop.run_in_executor(self._executor, self._runner.apply_weights, op.staged)
        except Exception as exc:
            _log.exception("engine.weight_update_failed")
            if not op.future.done():
                op.future.set_exception(exc)
            return
        finally:
            self._idle.set()
        # A new epoch makes every cached prefix unusable, whether or not the cache is flushed.
        self._epoch += 1
        if op.flush_cache:
            self._cache.clear()
        if op.weight_version is not None:
            self.weight_version = op.weight_version
        _log.info(
            "engine.weights_updated", version=self.weight_version, epoch=self._epoch, tensors=len(op.staged)
        )
        if not op.future.done():
            op.future.set_result(num_paused)

    def _plan(self) -> _Planned | None:
        if self.paused:
            return None
        self._reap()
        barrier = self._ops[0].barrier_seq if self._ops else None
        while self._waiting and self._free_slots and (barrier is None or self._waiting[0].seq < barrier):
            req = self._waiting.popleft()
            req.slot = self._free_slots.pop()
            self._running.append(req)
        prefills: list[Row] = []
        decodes: list[Row] = []
        pre_reqs: list[Request] = []
        dec_reqs: list[Request] = []
        for req in self._running:
            assert req.slot is not None
            ids = req.all_ids
            if req.prefilled:
                decodes.append(
                    Row(
                        slot=req.slot,
                        tokens=[ids[-1]],
                        start=len(ids) - 1,
                        params=req.params,
                        generator=req.generator,
                    )
                )
                dec_reqs.append(req)
                continue
            reused, entry = self._cache.lookup(ids, epoch=self._epoch)
            req.cached_tokens += reused
            # Cache the prompt's KV on its first prefill, unless the cache already covers it.
            save = len(req.prompt_ids) if not req.output_ids and reused < len(req.prompt_ids) - 1 else 0
            prefills.append(
                Row(
                    slot=req.slot,
                    tokens=ids[reused:],
                    start=reused,
                    params=req.params,
                    generator=req.generator,
                    reuse=entry,
                    save_prefix=save,
                )
            )
            pre_reqs.append(req)
        if not prefills and not decodes:
            return None
        return _Planned(
            plan=StepPlan(prefills=prefills, decodes=decodes),
            requests=pre_reqs + dec_reqs,
            version=self.weight_version,
            epoch=self._epoch,
        )

    def _apply(self, planned: _Planned, result: StepResult) -> None:
        for i, (k, v) in result.saved.items():
            self._cache.insert(planned.requests[i].prompt_ids, k, v, epoch=planned.epoch)
        for req, token, logprob in zip(planned.requests, result.tokens, result.logprobs, strict=True):
            if req.finished:  # aborted while the step ran: its token is dropped, its slot reaped
                continue
            req.prefilled = True
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            req.output_versions.append(planned.version)
            if (reason := self._finish_reason(req)) is not None:
                self._finish(req, reason)
        self.last_step_end_s = time.monotonic()
        self.last_gen_throughput = len(planned.requests) / max(result.seconds, 1e-9)

    def _finish_reason(self, req: Request) -> dict[str, Any] | None:
        # SGLang's order (schedule_batch.py update_finish_state): stop string, stop token/EOS, length.
        params, n, token = req.params, len(req.output_ids), req.output_ids[-1]
        if params.stop:
            longest = max(len(s) for s in params.stop)
            tail = self._detokenize(req.output_ids[-(longest + _STOP_TAIL_SLACK) :])
            for s in params.stop:
                if s in tail:
                    req.matched_stop = s
                    return {"type": "stop", "matched": s}
        if not params.ignore_eos and (token in self._eos or token in params.stop_token_ids):
            return {"type": "stop", "matched": token}
        if n >= params.max_new_tokens or len(req.prompt_ids) + n >= self.context_len:
            return {"type": "length", "length": n}
        return None

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        if self._by_rid.get(req.rid) is req:
            del self._by_rid[req.rid]
        if not req.future.done():
            req.future.set_result(None)

    def _drop_finished_waiting(self) -> None:
        if any(r.finished for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.finished)

    def _reap(self) -> None:
        """Free the slots of finished requests; only while the compute thread is not using them."""
        if not self._idle.is_set():
            return
        for req in self._running:
            if req.finished:
                self._release_slot(req)
        self._running = [r for r in self._running if not r.finished]

    def _release_slot(self, req: Request) -> None:
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None


def _abort_reason(message: str) -> dict[str, Any]:
    # SGLang's FINISH_ABORT.to_json(); status_code None means "answer 200 with the partial output".
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}

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
import heapq
import itertools
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
import torch

from miles_aio.engine.protocol import BadRequest, PauseMode
from miles_aio.engine.runner import ModelRunner, PrefixCache, Row, ScoredInput, StepPlan, StepResult
from miles_aio.engine.sampling import RowSampling, SamplingParams

__all__ = ["EngineClosed", "LocalEngine", "LogprobOptions", "Request", "RequestAborted", "TokenLogprobs"]

_log = structlog.get_logger(__name__)
_STOP_TAIL_SLACK: Final = 2
"""Extra tokens decoded beyond the longest stop string when checking for it (a token is >= 1 char)."""
SHARE_MIN_TOKENS_ENV: Final = "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD"
"""SGLang's environment variable for the shortest shared prompt its scheduler defers (SGLang: 32)."""
_SHARE_MIN_TOKENS: Final = int(os.environ.get(SHARE_MIN_TOKENS_ENV, "2"))
"""Identical uncached prompts at least this long are prefilled once per step (see `_plan`). SGLang
defers only prompts of 32 tokens and more, where a GPU's prefill of fewer costs less than a step's
wait; on a CPU every token of a prefill costs its share: prefilling each of the quickstart's 6-token
prompts once instead of 8 times takes its 256-sample batches 0.86-0.90x the time
(`benchmarks.group_prefill`). 2: every prompt that can be cached (a prompt's last token is always fed)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down; queued work was dropped."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobOptions:
    """What logprobs a request asks for, beyond the sampled token's own (SGLang's /generate fields)."""

    start_len: int | None = None
    """`logprob_start_len`: score the prompt tokens from this position on (input logprobs); None: none."""
    top_n: int = 0
    """`top_logprobs_num`: the n most likely tokens at every scored position (0: none)."""
    token_ids: tuple[int, ...] = ()
    """`token_ids_logprob`: these tokens' logprobs at every scored position."""


TokenLogprobs = list[tuple[float, int]]
"""(logprob, token id) pairs at one position: the top-n, or the asked-for token ids, in SGLang's order."""


@dataclass(eq=False, kw_only=True)
class Request:
    """One generation's state. Owned by the engine; the HTTP layer reads it as `progress` announces output.

    Input logprobs (`input_*`) cover prompt positions `logprobs.start_len ..`, the first entry None (as
    SGLang: the logits at position s score token s + 1). Output lists hold one entry per output token.
    """

    rid: str
    seq: int
    prompt_ids: list[int]
    params: SamplingParams
    rng: random.Random
    """The request's own sampling RNG: its draws never depend on what shares its batch."""
    future: asyncio.Future[None]
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    created_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    """The weight version of the step that produced each output token."""
    output_top_logprobs: list[TokenLogprobs] = field(default_factory=list)
    output_token_ids_logprobs: list[TokenLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    input_token_ids_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever output grows or the request finishes; a stream reader clears it before reading."""
    queued_s: float | None = None
    """When the request entered the waiting queue (again, after a retraction); None while running, and
    while held: it arrived during a pause or with a weight update pending (SGLang keeps those outside its
    queue until then; see `submit`)."""
    started_s: float | None = None
    """When it first ran (SGLang's `forward_entry_time`, kept across retractions); None before."""
    cache_namespace: tuple[str | None, str | None] = (None, None)
    """SGLang's (`extra_key`, `cache_salt`): prefix-cache entries are shared only within one namespace."""
    row_sampling: RowSampling | None = None
    """What the compute thread needs to sample for it (built on first use)."""
    prefill_only: bool = False
    """Compute and cache the prompt's KV, produce nothing (SGLang's warm-up before n > 1 samples)."""
    scored: bool = False
    """Its input logprobs are computed (a retracted request is re-prefilled without re-scoring)."""
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


@dataclass(eq=False, kw_only=True)
class _WeightOp:
    staged: dict[str, torch.Tensor]
    weight_version: str | None
    flush_cache: bool
    barrier_seq: int
    """Requests with seq < barrier_seq finish before an unpaused update applies; later ones wait."""
    future: asyncio.Future[tuple[int, bool]]


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
        self._seeds = random.Random(seed)
        self._seq = itertools.count()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._by_rid: dict[str, Request] = {}
        self._free_slots = list(range(self.max_running))
        """A heap: the lowest free slot first, so running requests tend to hold consecutive slots, which
        the decode step reads as one view of the KV pool instead of a gather."""
        self._ops: deque[_WeightOp] = deque()
        self.paused: PauseMode | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while no step or weight copy is running on the compute thread
        self._idle.set()
        self._closed = False
        self._failures = _FailureLog()
        self._unreaped = False
        """Some running request finished since the last `_reap` (which is then a no-op otherwise)."""
        self.forward_sleep_s: float | None = None
        self.last_step_end_s = 0.0
        self.last_gen_throughput = 0.0
        # ---- for timeouts.Supervisor (request timeouts, watchdog) ----
        self.deadlines_changed = asyncio.Event()
        """Set when a request's timeout clock starts or a pause ends: the supervisor re-reads deadlines."""
        self.last_step_start_s = time.monotonic()
        """When the latest forward started (the watchdog's progress mark)."""

    # ---- requests ----

    def new_request(
        self,
        *,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        logprobs: LogprobOptions | None = None,
        cache_namespace: tuple[str | None, str | None] = (None, None),
        prefill_only: bool = False,
    ) -> Request:
        """Validate against the model's limits (SGLang's wording) and build the request; BadRequest if not."""
        if rid in self._by_rid:
            raise BadRequest(f"Duplicate request ID detected: {rid}")  # SGLang's _init_req_state
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
        asked = logprobs.token_ids if logprobs is not None else ()
        if bad := [t for t in asked if not 0 <= t < self._vocab]:
            raise BadRequest(f"token_ids_logprob id {bad[0]} is out of range for vocab size {self._vocab}")
        if bad := [t for t, _ in params.logit_bias if not 0 <= t < self._vocab]:
            raise BadRequest(f"logit_bias must has keys in [0, {self._vocab - 1}], got {bad[0]}.")  # sic
        seed = params.sampling_seed
        if seed is None:  # one draw per request from the engine seed: batching never changes a request's RNG
            seed = self._seeds.getrandbits(62)
        return Request(
            rid=rid,
            seq=next(self._seq),
            prompt_ids=list(prompt_ids),
            params=params,
            rng=random.Random(seed),
            future=asyncio.get_running_loop().create_future(),
            logprobs=logprobs or LogprobOptions(),
            cache_namespace=cache_namespace,
            prefill_only=prefill_only,
        )

    def submit(self, req: Request) -> None:
        """Queue `req` (never blocks); its `future` resolves and `progress` is set when it finishes."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if req.params.max_new_tokens == 0 and req.logprobs.start_len is None and not req.prefill_only:
            self._finish(req, {"type": "length", "length": 0})  # nothing to compute
            return
        self._by_rid[req.rid] = req
        # Held (no waiting clock yet) while paused or while a weight update is pending: SGLang keeps such a
        # request in its tokenizer manager (pause condition, weights lock) until then.
        req.queued_s = None if self.paused or self._ops else time.monotonic()
        self._waiting.append(req)
        self._wake.set()
        self.deadlines_changed.set()

    async def generate(self, req: Request) -> Request:
        """Queue `req` and wait until it finishes. Cancelling the caller aborts the request."""
        self.submit(req)
        try:
            await req.future
        except asyncio.CancelledError:
            self._disconnect(req)
            raise
        _raise_for_abort_status(req)
        return req

    async def stream(self, req: Request) -> AsyncIterator[int]:
        """Queue `req` and yield how many output tokens it has, each time that grows, until it finishes.

        The caller reads `req.output_ids[:n]` (and the other per-token lists) after each yield; the last
        yield comes once `req.finished`. Nothing is polled: the engine sets `req.progress` after every
        step that touched the request. Leaving the loop early (break, cancellation) aborts the request.
        """
        self.submit(req)
        try:
            sent = 0
            while True:
                req.progress.clear()
                if len(req.output_ids) > sent or req.finished:
                    sent = len(req.output_ids)
                    yield sent
                    if req.finished:
                        return
                    continue
                await req.progress.wait()
        finally:
            self._disconnect(req)

    def _disconnect(self, req: Request) -> None:
        if not req.finished:
            self._finish(req, _abort_reason("client disconnected"))
            self._drop_finished_waiting()

    def abort(self, *, rid: str = "", abort_all: bool = False, message: str = "Aborted") -> int:
        """Finish the targeted requests now, keeping what they produced; returns how many. Never blocks.

        SGLang's rules (tokenizer_manager.abort_request, scheduler.abort_request): a rid that is not live
        aborts nothing; a live one aborts every request whose rid starts with it. A request in the queue
        finishes with {"type": "abort", "message": "Abort in waiting queue"}, a running one with
        FINISH_ABORT(message) (SGLang's message: "Aborted")."""
        if abort_all:
            targets = list(self._by_rid.values())
        else:
            live = rid in self._by_rid
            targets = [r for r in self._by_rid.values() if r.rid.startswith(rid)] if live else []
        for req in targets:
            self._finish(req, _WAITING_ABORT.copy() if req.slot is None else _abort_reason(message))
        self._drop_finished_waiting()
        self._wake.set()
        return len(targets)

    def expire(self, requests: list[Request], reason: dict[str, Any]) -> None:
        """Finish `requests` now with `reason` (a timeout's), keeping what they produced."""
        for req in requests:
            self._finish(req, dict(reason))
        self._drop_finished_waiting()
        self._wake.set()

    def timed_requests(self) -> list[Request]:
        """The unfinished requests, waiting and running: what request timeouts apply to."""
        return [r for r in (*self._waiting, *self._running) if not r.finished]

    def watchdog_active(self) -> bool:
        """SGLang's `cur_batch_for_debug is not None`: requests in the running batch (a step in flight, or
        frozen by an in_place pause); retract and abort pauses leave none."""
        return bool(self._running)

    @property
    def is_paused(self) -> bool:
        return self.paused is not None

    # ---- control ----

    async def pause(self, mode: PauseMode) -> None:
        """Stop computing; returns once no step is running (see the module docstring for the modes)."""
        self.paused = mode
        if mode == "abort":
            self.abort(abort_all=True)  # SGLang's pause(abort) is abort_request(abort_all=True)
        # Loop: an Event wakes its waiters even if it was cleared again before they ran (a weight copy may
        # have started). From the is_set() check to the end there is no await, so nothing can start.
        while not self._idle.is_set():
            await self._idle.wait()
        if self.paused != mode:
            return  # continued, or paused in another mode, while we waited: that call decides
        self._reap()
        if mode == "retract":
            retracted = [r for r in self._running if not r.finished]
            now = time.monotonic()
            for req in retracted:
                self._release_slot(req)
                req.prefilled = False
                req.num_retractions += 1
                req.queued_s = now  # back in the queue: its waiting clock restarts, as SGLang's
            self._running = []
            self._waiting.extendleft(reversed(retracted))
            self.deadlines_changed.set()
        _log.info("engine.paused", mode=mode, running=len(self._running), waiting=len(self._waiting))

    def resume(self) -> None:
        self.paused = None
        self._release_held()
        self._wake.set()

    def _release_held(self) -> None:
        """Held requests reach the queue (their waiting clock starts), unless still paused or an update is
        pending (see `submit`)."""
        if self.paused or self._ops:
            return
        now = time.monotonic()
        for req in self._waiting:
            if req.queued_s is None and req.started_s is None:
                req.queued_s = now
        self.deadlines_changed.set()

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
    ) -> tuple[int, bool]:
        """Swap in validated tensors between steps; returns SGLang's `num_paused_requests` and whether the
        asked-for cache flush happened (SGLang refuses it, after loading, while requests hold KV)."""
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
        self.deadlines_changed.set()
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
            self.last_step_start_s = time.monotonic()
            try:
                result = await loop.run_in_executor(self._executor, self._runner.step, planned.plan)
            except Exception as exc:  # a bug in the forward: find the rows that fail, keep serving the rest
                self._failures.report(exc, rows=len(planned.requests))
                if len(planned.requests) > 1:
                    await self._isolate(planned, loop)
                else:
                    self._fail(planned.requests[0], exc)
            else:
                self._apply(planned, result)
            finally:
                self._idle.set()
                self._reap()
            if self.forward_sleep_s:  # SGLang's /slow_down test hook: a slower "forward", not holding the KV
                await asyncio.sleep(self.forward_sleep_s)

    async def _isolate(self, planned: _Planned, loop: asyncio.AbstractEventLoop) -> None:
        """Re-run a failed step row by row (steps are idempotent on the KV): only the rows that fail
        alone fail their request; the others get their token as if the step had succeeded."""
        for i, req in enumerate(planned.requests):
            if req.finished:
                continue
            single = _Planned(
                plan=planned.plan.single(i), requests=[req], version=planned.version, epoch=planned.epoch
            )
            self.last_step_start_s = time.monotonic()
            try:
                result = await loop.run_in_executor(self._executor, self._runner.step, single.plan)
            except Exception as exc:
                self._failures.report(exc, rows=1)
                self._fail(req, exc)
            else:
                self._apply(single, result)

    def _fail(self, req: Request, exc: Exception) -> None:
        req.error = f"{type(exc).__name__}: {exc}"
        _log.warning("engine.request_failed", rid=req.rid, error=req.error)
        self._finish(req, _abort_reason(f"internal error: {req.error}"))

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
            self._release_held()
            return
        finally:
            self._idle.set()
        # A new epoch makes every cached prefix unusable, whether or not the cache is flushed.
        self._epoch += 1
        flushed = True
        if op.flush_cache:  # SGLang's flush_cache_after_weight_update: refused while requests hold KV
            flushed = not any(not r.finished for r in self._running)
            if flushed:
                self._cache.clear()
        if op.weight_version is not None:
            self.weight_version = op.weight_version
        _log.info(
            "engine.weights_updated", version=self.weight_version, epoch=self._epoch, tensors=len(op.staged)
        )
        if not op.future.done():
            op.future.set_result((num_paused, flushed))
        self._release_held()

    def _plan(self) -> _Planned | None:
        if self.paused:
            return None
        self._reap()
        barrier = self._ops[0].barrier_seq if self._ops else None
        # In-batch prefix sharing (SGLang's schedule policy does the same): of several waiting requests
        # with one uncached prompt (a GRPO group), the first prefills it now and the others wait one step,
        # then start from its cached KV instead of each computing the whole prompt again.
        fresh: set[tuple[tuple[str | None, str | None], tuple[int, ...]]] = set()
        deferred: list[Request] = []
        while self._waiting and self._free_slots and (barrier is None or self._waiting[0].seq < barrier):
            req = self._waiting.popleft()
            if not req.output_ids and len(req.prompt_ids) >= _SHARE_MIN_TOKENS and self._cache.max_entries:
                key = (req.cache_namespace, tuple(req.prompt_ids))
                if key in fresh:
                    deferred.append(req)
                    continue
                hit, _ = self._cache.lookup(req.prompt_ids, epoch=self._epoch, namespace=req.cache_namespace)
                if hit < len(req.prompt_ids) - 1:
                    fresh.add(key)
            req.slot = heapq.heappop(self._free_slots)
            req.queued_s = None
            if req.started_s is None:
                req.started_s = time.monotonic()
            self.deadlines_changed.set()  # its running clock starts, or the watchdog becomes active
            self._running.append(req)
        self._waiting.extendleft(reversed(deferred))
        prefills: list[Row] = []
        decodes: list[Row] = []
        pre_reqs: list[Request] = []
        dec_reqs: list[Request] = []
        caching: set[tuple[tuple[str | None, str | None], tuple[int, ...]]] = set()  # prompts saved this step
        for req in self._running:
            assert req.slot is not None
            if req.prefilled:  # feed only the newest token: O(1) per request, however long it is
                decodes.append(
                    Row(
                        slot=req.slot,
                        tokens=[req.output_ids[-1]],
                        start=len(req.prompt_ids) + len(req.output_ids) - 1,
                        sampling=self._sampling(req),
                    )
                )
                dec_reqs.append(req)
                continue
            prefills.append(self._prefill_row(req, caching))
            pre_reqs.append(req)
        if not prefills and not decodes:
            return None
        return _Planned(
            plan=StepPlan(prefills=prefills, decodes=decodes),
            requests=pre_reqs + dec_reqs,
            version=self.weight_version,
            epoch=self._epoch,
        )

    def _sampling(self, req: Request) -> RowSampling | None:
        if len(req.output_ids) >= req.params.max_new_tokens:
            return None  # max_new_tokens 0: a prefill that only scores its input
        if req.row_sampling is None:  # built once: every field is fixed, `output_ids` is the live list
            p = req.params
            req.row_sampling = RowSampling(
                params=p,
                rng=req.rng,
                output_ids=req.output_ids,
                stop_ids=(self._eos | p.stop_token_ids) if p.min_new_tokens else frozenset(),
                top_n=req.logprobs.top_n,
                token_ids=req.logprobs.token_ids,
            )
        return req.row_sampling

    def _prefill_row(
        self, req: Request, caching: set[tuple[tuple[str | None, str | None], tuple[int, ...]]]
    ) -> Row:
        """Prefill prompt + output so far, reusing cached prompt KV, and scoring the prompt if asked.
        `caching`: the prompts (with their cache namespace) whose KV a row of this step already saves.

        SGLang's input logprobs for `logprob_start_len` s: the logits of positions s.. score the tokens
        s + 1.. (the token at s itself gets None), so the reusable cache prefix is capped at s, as SGLang
        caps its prefix match (`Req._compute_max_prefix_len`)."""
        ids = req.prompt_ids + req.output_ids
        start_len = req.logprobs.start_len
        score = start_len is not None and not req.scored and start_len + 1 < len(req.prompt_ids)
        first_scored = (start_len or 0) + 1
        reused, entry = self._cache.lookup(ids, epoch=self._epoch, namespace=req.cache_namespace)
        if start_len is not None and not req.scored and reused > start_len:
            reused = start_len
            entry = entry if reused else None
        req.cached_tokens += reused
        # Cache the prompt's KV on its first prefill, unless the cache already covers it or another row of
        # this step saves the same prompt (a group's samples prefilled together: one copy, not n).
        save = 0
        if not req.output_ids and reused < len(req.prompt_ids) - 1 and self._cache.max_entries > 0:
            key = (req.cache_namespace, tuple(req.prompt_ids))
            if key not in caching:
                caching.add(key)
                save = len(req.prompt_ids)
        return Row(
            slot=req.slot if req.slot is not None else -1,
            tokens=ids[reused:],
            start=reused,
            sampling=self._sampling(req),
            reuse=entry,
            save_prefix=save,
            score_from=(first_scored - reused) if score else None,
            score_top_n=req.logprobs.top_n,
            score_token_ids=req.logprobs.token_ids,
        )

    def _apply(self, planned: _Planned, result: StepResult) -> None:
        for i, (k, v) in result.saved.items():
            req = planned.requests[i]
            self._cache.insert(req.prompt_ids, k, v, epoch=planned.epoch, namespace=req.cache_namespace)
        for i, scored in result.scored.items():
            self._record_input_logprobs(planned.requests[i], scored)
        for req, drawn in zip(planned.requests, result.sampled, strict=True):
            if req.finished:  # aborted while the step ran: its token is dropped, its slot reaped
                continue
            req.prefilled = True
            if (start := req.logprobs.start_len) is not None and not req.scored:
                req.scored = True
                if start < len(req.prompt_ids) and not req.input_logprobs:  # only the start token: None
                    req.input_logprobs = [None]
                    req.input_top_logprobs = [None] if req.logprobs.top_n else []
                    req.input_token_ids_logprobs = [None] if req.logprobs.token_ids else []
            if drawn is None:  # a score-only request is done once its prompt is scored
                self._finish(req, {"type": "length", "length": len(req.output_ids)})
                continue
            req.output_ids.append(drawn.token)
            req.output_logprobs.append(drawn.logprob)
            req.output_versions.append(planned.version)
            if drawn.top is not None:
                req.output_top_logprobs.append(drawn.top)
            if drawn.token_ids is not None:
                req.output_token_ids_logprobs.append(drawn.token_ids)
            if (reason := self._finish_reason(req)) is not None:
                self._finish(req, reason)
            else:
                req.progress.set()
        self.last_step_end_s = time.monotonic()
        self.last_gen_throughput = len(planned.requests) / max(result.seconds, 1e-9)

    def _record_input_logprobs(self, req: Request, scored: ScoredInput) -> None:
        """SGLang's input_* lists: one entry per prompt token from `logprob_start_len` on, the first None."""
        req.input_logprobs = [None, *scored.logprobs]
        if scored.top is not None:
            req.input_top_logprobs = [None, *scored.top]
        if scored.token_ids is not None:
            req.input_token_ids_logprobs = [None, *scored.token_ids]

    def _finish_reason(self, req: Request) -> dict[str, Any] | None:
        # SGLang's order (schedule_batch.py update_finish_state): stop string, stop token/EOS, length.
        params, n, token = req.params, len(req.output_ids), req.output_ids[-1]
        if n < params.min_new_tokens and n < params.max_new_tokens:
            return None if len(req.prompt_ids) + n < self.context_len else {"type": "length", "length": n}
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
        self._unreaped = True
        if self._by_rid.get(req.rid) is req:
            del self._by_rid[req.rid]
        if not req.future.done():
            req.future.set_result(None)
        req.progress.set()

    def _drop_finished_waiting(self) -> None:
        if any(r.finished for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.finished)

    def _reap(self) -> None:
        """Free the slots of finished requests; only while the compute thread is not using them."""
        if not self._idle.is_set() or not self._unreaped:
            return
        self._unreaped = False
        for req in self._running:
            if req.finish_reason is not None:
                self._release_slot(req)
        self._running = [r for r in self._running if r.finish_reason is None]

    def _release_slot(self, req: Request) -> None:
        if req.slot is not None:
            heapq.heappush(self._free_slots, req.slot)
            req.slot = None


def _abort_reason(message: str = "Aborted") -> dict[str, Any]:
    # SGLang's FINISH_ABORT.to_json(); status_code None means "answer 200 with the partial output".
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


_WAITING_ABORT: Final[dict[str, Any]] = {"type": "abort", "message": "Abort in waiting queue"}
"""What SGLang's tokenizer manager reports for a request aborted in the queue (`_handle_abort_req`)."""


class RequestAborted(Exception):
    """A request aborted with an HTTP status (a timeout: 503): the HTTP layer answers with that status,
    as SGLang's `_handle_abort_finish_reason` does for a non-streaming request."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def _raise_for_abort_status(req: Request) -> None:
    reason = req.finish_reason or {}
    code = reason.get("status_code")
    if reason.get("type") == "abort" and isinstance(code, int) and 400 <= code < 600:
        raise RequestAborted(str(reason.get("message", "Aborted")), code)


class _FailureLog:
    """Step failures, logged without flooding: the first occurrence of each distinct error with its
    traceback (no locals), repeats as one counted line each."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}

    def report(self, exc: Exception, *, rows: int) -> None:
        key = (type(exc).__name__, str(exc)[:200])
        count = self._seen.get(key, 0) + 1
        self._seen[key] = count
        if count == 1:
            _log.error("engine.step_failed", rows=rows, exc_info=exc)
        else:
            _log.warning("engine.step_failed_again", rows=rows, error=f"{key[0]}: {key[1]}", times=count)

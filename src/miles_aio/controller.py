"""The controller: one event loop, one TaskGroup, the driver step loop of a fully async RL run.

    DataSource ─► RolloutWorker ─(admit)─► RolloutPool ─► DataBuffer.put ┐
       ▲ recycle        ▲ versions, consumed/discarded                    │
       └── on_unused ◄──┴────────────── DataBuffer.get ◄── drain ◄────────┘
                                                           │
       step loop:  drain(B groups) ─► Trainer.train ─► every I steps: pause → sync → stamp → continue

Construction (`Controller.__init__`) builds every component in dependency order, each from what exists
already (no component imports the controller or is wired after construction): the ledger and the
tracer; the limiter, the engine client and the rollout context; the producer side — the admission gate
(the scheduler state, and the notifier that wakes admission), the step accounting, the group fates (the
buffer's callbacks), the buffer, the pool, the worker —; adaptive concurrency (`auto` only); the
observer and the eval points.

Tasks (all owned by `run()`'s TaskGroup):
  rollout-worker  produces finished groups into the buffer; never waits for training.
                  Waits for admission (in-flight bound, full buffer, pacing); unblocked by group
                  completion, consumption and new versions.
  drain-<step>    consumes B groups from the buffer for one step (one step ahead of training);
                  waits for `buffer.get()`; unblocked by the worker's puts. The push after step s waits
                  for the drain of step s+1 to finish, so a batch is drained at a single version.
  adaptive-concurrency  with `--async-max-concurrent-samples auto` only: resizes the limiter and the
                  in-flight bound every interval (`miles_aio.scheduler.adaptive`); ends with the worker.
  agent-sessions  with --custom-agent-function-path only: the agents' OpenAI-compatible session endpoint
                  (`miles_aio.rollout.agent.SessionServer`); answers agents until cancelled at the end.
  weight-push-v<version>  with --overlap-weight-push only: a disk push once rank 0 has written the
                  weights (the engines' pause, load, stamp and continue), alongside the next step's
                  training. Awaited after that training, and before a save, an eval point or the run's
                  end (they read the pushed weights).
  engine-load-step-<step>  reads the engines' load (`/server_info`, `perf/engine/*`) while the step
                  trains, after the push running alongside it, if any; awaited by the step's record
                  (bounded by the read's 2 s timeout per engine).
  free-batch-<step>  drops a recorded step's batch `METRICS_CHUNK_SAMPLES` samples at a time, the loop
                  let run between chunks (freeing 50,000 samples and their per-token lists at once
                  stalled every rollout ~50 ms); waits for nothing else.
  the body        the step loop: trains, pushes weights, saves, evaluates, logs metrics.

Step numbers count steps done: step N is the N-th step (1-based), after which N steps are trained.
Its metrics record has `step` N, the checkpoint saved after it is `step_N` (`latest` names N), the
eval point on its weights has `eval/step` N (the point before training: 0), the ledger marks its
groups `trained` with step N, its log lines carry step=N and its trace slice is "step N". A run
resumed from `step_N` starts with step N+1. Intervals count the same way: --save-interval 100 of
--num-rollout 300 saves step_100, step_200, step_300.

The step loop (`_step_loop`, one `_step` per step; each phase timed by the step's `StepClock`):

    for step in range(start + 1, num_rollout + 1):
        batch = the drain of step (started one step ahead)    # wait_data
        start the drain of step + 1
        train(step, batch)                                     # train
        the previous push is done                              # weight_sync (it ran alongside the training)
        every I steps and after the last: _push_after_barrier  # finish the drain of step + 1 (wait_data),
                                                               # the eval point in flight (eval), stage the
                                                               # weights (disk: rank 0 writes them) and
                                                               # push (weight_sync; --overlap-weight-push:
                                                               # it goes on during the next training)
        a save, an eval point or the last step: the push is done first (weight_sync)
        stop requested: save now; else save every --save-interval steps and after the last step
        an eval point due (not when stopping): dispatch it; the last step waits for its point (eval)
        the step's record: metrics, the buffer window cut at its drain, perf/* from its clock

Shutdown (healthy): after the last step the worker is cancelled; in-flight groups are recorded
`pending_at_exit` in the ledger. Stop (`request_stop()`, on SIGINT/SIGTERM): the step in progress
finishes (a wait for data ends at once; its weight push is skipped when it would first wait for the
next batch), a checkpoint with every pending group is saved, the step's metrics record is written, then
as healthy. A stop that ends the wait for a step's batch (`_StopRequested`) ends the loop before that
step, saving the previous one; a stop right after a periodic save saves once. A stop during the last
step is just the end of the run (the last step always pushes, evaluates and saves as usual).
Crash: a worker exception is kept, the buffer closed, and the next drain re-raises it — the worker's
own error (the user's exception type, so `except MyError` around the run works), with a note naming
the step; any other failing task cancels the group. The run raises the primary error of the group
(`errors.primary_error`: the others are attached as notes and logged).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from miles_aio._aio import LoopShare
from miles_aio._durable import fault_point
from miles_aio._gc import paced_gc
from miles_aio.buffer import BufferItem, DataBuffer, DataBufferContext
from miles_aio.buffer.fates import GroupFates, normalize_filter
from miles_aio.checkpoint import (
    ControllerState,
    buffered_items,
    latest_checkpoint,
    prepare_step_dir,
    publish_latest,
    read_controller_state,
    write_controller_state,
)
from miles_aio.config import RunConfig
from miles_aio.data.source import DataSource, PromptRecord
from miles_aio.errors import BufferClosed, primary_error
from miles_aio.eval.build import build_eval_dispatcher
from miles_aio.eval.dispatcher import EvalPoints
from miles_aio.eval.snapshots import save_hf_checkpoint
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.router import EngineRouter
from miles_aio.ledger import Ledger
from miles_aio.metrics import BatchStats, MetricsSink
from miles_aio.observability.accounting import StepAccounting, StepClock
from miles_aio.observability.observer import RunObserver, run_tracer
from miles_aio.plugins import Plugins
from miles_aio.rollout.agent import agent_sessions
from miles_aio.rollout.context import LimitedEngine, RolloutContext, Tokenizer
from miles_aio.rollout.limiter import Limiter
from miles_aio.rollout.pool import RolloutPool
from miles_aio.scheduler.adaptive import AdaptiveConcurrency, load_sampler
from miles_aio.scheduler.policy import AdmissionLimits, DrainSchedule
from miles_aio.scheduler.worker import AdmissionGate, RolloutWorker
from miles_aio.trainer.base import Trainer
from miles_aio.types import Group, RunSummary

__all__ = ["Controller", "RunSummary"]

log = structlog.get_logger("miles_aio.controller")

METRICS_CHUNK_SAMPLES = 16
"""Samples of a step's batch that are drained from a full buffer, whose metrics are counted, or that are
freed, between two passes of the event loop (`Controller._drain`, `Controller._batch_metrics`,
`Controller._free`). Each chunk lengthens the pass it runs in, and a busy loop lengthens the next pass by
what arrived meanwhile: at 50,000 in flight and ~5,400 requests/s (`benchmarks.controller`'s lag case)
chunks of 64 kept the loop lag's p99 at 10-11 ms, chunks of 16 at 4.4-4.6 ms (session 20; 256 → 64 took
`benchmarks.soak`'s p99 from 12.5 to 3.6 ms, docs/guide/scaling.md)."""


class _StopRequested(Exception):
    """`request_stop()` cancelled the drain the step loop was waiting for (`Controller._finish_drain`)."""


def admission_limits(cfg: RunConfig) -> AdmissionLimits:
    """The admission policy's limits for `cfg` (the in-flight bound is the initial one with `auto`)."""
    return AdmissionLimits(
        max_in_flight_samples=cfg.max_in_flight_samples,
        group_size=cfg.rollout.n_samples_per_prompt,
        granularity=cfg.scheduler.rollout_submission_granularity,
        max_admission_staleness=cfg.scheduler.max_admission_staleness,
        schedule=DrainSchedule(
            batch_groups=cfg.rollout.rollout_batch_size,
            update_interval=cfg.driver.update_weights_interval,
        ),
    )


class Controller:
    """Owns every component of one run. Construct it whole, then `await controller.run()` once."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        engine: InferenceEngine,
        trainer: Trainer,
        source: DataSource,
        plugins: Plugins,
        tokenizer: Tokenizer | None = None,
        num_engines: int = 1,
        sinks: Sequence[MetricsSink] = (),
        eval_datasets: Mapping[str, Sequence[PromptRecord]] | None = None,
        evals: EvalPoints | None = None,
        eval_engine: InferenceEngine | None = None,
        write_files: bool = True,
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.source = source.bind_tokenizer(tokenizer, cfg.rollout.rollout_max_prompt_len)
        # the step loop's own state
        self.version: int | None = None
        self.start_step = 0  # the steps done when the run starts: N when resumed from step_N
        self.stopped = False
        self._worker_error: BaseException | None = None
        self._weights_ahead = False
        self._push: asyncio.Task[None] | None = None  # a push running alongside the next step's training
        self._push_s = 0.0  # seconds of the latest push, from its pause to its publish
        self._carry: list[BufferItem] = []  # drained before a checkpoint, not yet trained: consumed first
        self._next_drain: asyncio.Task[list[BufferItem]] | None = None
        self._draining: list[BufferItem] = []  # groups the current drain has taken so far
        self._saved_step = -1  # a stop right after a periodic save does not save the same step again
        self._saved_dir: Path | None = None  # that checkpoint's directory (saved, or resumed from)
        self.saved_this_run = False  # whether this run saved a checkpoint (not only resumed from one)
        self._last_step = 0  # the steps done so far (the number of the last finished step)
        self._drained_metrics: dict[int, dict[str, float]] = {}  # buffer window of each step's drain
        self._times_read_at: float | None = None  # when the last step's times were read: the next one's start
        self._stop = asyncio.Event()

        # The components, in dependency order: each is built from those above it, and nothing is wired
        # after construction. 1. What records the run: the ledger of group fates, the timeline trace.
        self.ledger = Ledger(
            cfg.run_dir / "ledger.jsonl" if write_files else None, dataset_size=source.dataset_size
        )
        self.tracer = run_tracer(cfg, write_files=write_files)
        # 2. The engines behind one limiter, and the context user code runs with.
        self.limiter = Limiter(cfg.rollout.sglang_server_concurrency * num_engines)
        self.engine = limited = LimitedEngine(engine, self.limiter, tracer=self.tracer)
        self.ctx = RolloutContext(
            engine=limited,
            tokenizer=tokenizer,
            config=cfg,
            log=structlog.get_logger("miles_aio.rollout"),
            sessions=agent_sessions(cfg, tokenizer),  # the agent session endpoint, with an agent (else None)
        )
        # 3. The producer side: admission gate → step accounting → group fates → buffer → pool → worker.
        self.gate = AdmissionGate(admission_limits(cfg))
        self.accounting = StepAccounting(
            blocked_seconds=self.gate.blocked_seconds, generated_tokens=lambda: limited.generated_tokens
        )
        self.fates = GroupFates(
            handler=cfg.buffer.async_unused_samples_handler,
            failure_policy=cfg.rollout.rollout_failure_policy,
            max_recycles=cfg.buffer.max_group_recycles,
            discard=self.gate.on_discarded,
            ledger=self.ledger,
            source=source,
            accounting=self.accounting,
        )
        self.buffer: DataBuffer = plugins.buffer_cls(
            DataBufferContext(
                config=cfg,
                on_unused=self.fates.on_unused,
                on_filtered=self.fates.on_filtered,
                dynamic_filter=normalize_filter(plugins.dynamic_filter_fn, self.ctx),
            )
        )
        self.pool = RolloutPool(
            ctx=self.ctx,
            generate_fn=plugins.generate_fn,
            reward_fn=plugins.reward_fn,
            group_rm=cfg.rollout.group_rm,
        )
        self.worker = RolloutWorker(
            gate=self.gate, source=source, pool=self.pool, buffer=self.buffer, ledger=self.ledger
        )
        # 4. Adaptive concurrency (`--async-max-concurrent-samples auto`, else None).
        self.adaptive = AdaptiveConcurrency.from_config(
            cfg,
            limiter=self.limiter,
            gate=self.gate,
            accounting=self.accounting,
            generated_tokens=lambda: limited.generated_tokens,
            sample_load=load_sampler(engine),
        )
        # 5. What reports: the observer (sinks, hooks, counters of the buffer and the scheduler state), evals.
        self.obs = RunObserver(
            cfg,
            engine,
            tracer=self.tracer,
            buffer=self.buffer,
            state=self.gate.state,
            sinks=sinks,
            write_files=write_files,
        )
        self.sinks = self.obs.sinks  # the metrics sinks
        self.evals: EvalPoints = evals or build_eval_dispatcher(
            cfg,
            controller_ctx=self.ctx,
            plugins=plugins,
            trainer=trainer,
            eval_datasets=eval_datasets,
            eval_engine=eval_engine,
        )

    # -- the run ---------------------------------------------------------------------------------------
    async def run(self) -> RunSummary:
        summary = RunSummary()
        t0 = time.monotonic()
        try:
            await self._run_tasks(summary)
        except BaseException as e:
            error = primary_error(e)
            self._close_files(summary.steps, error)
            if error is e:
                raise
        else:
            self._close_files(summary.steps, None)
            summary.version = self.version
            summary.wall_s = time.monotonic() - t0
            summary.ledger_counts = dict(self.ledger.counts)
            return summary
        raise error  # out of the handler: the primary error keeps its own traceback, cause and context

    async def _run_tasks(self, summary: RunSummary) -> None:
        """The run's TaskGroup: sessions, restore, the initial push and eval point, the worker, the loop."""
        async with paced_gc(), asyncio.TaskGroup() as tg:
            # agent sessions (--custom-agent-function-path): serving before any rollout or eval starts
            sessions, serving = self.ctx.sessions, None
            if sessions is not None:
                serving = tg.create_task(sessions.serve(), name="agent-sessions")
                await sessions.ready.wait()
            if self.cfg.driver.load is not None:
                await self._restore(self.cfg.driver.load)
            # version 1 on a fresh run; a resumed run re-stamps the checkpoint weights with their version
            await self._push_weights(self.version or 1)
            if self.start_step == 0 and self.evals.due(0):
                self.evals.dispatch(tg, steps_done=0, version=1)
                self.obs.eval_dispatched(0)
            worker = tg.create_task(self._supervise_worker(), name="rollout-worker")
            if self.adaptive is not None:
                tg.create_task(self.adaptive.run(worker), name="adaptive-concurrency")
            try:
                await self._step_loop(tg, summary)
            finally:
                worker.cancel()
                if serving is not None:
                    serving.cancel()

    def _close_files(self, steps: int, error: BaseException | None) -> None:
        """Record the groups still open, close the ledger and the observer's files. The first error is
        the one reported: a failure here (a full disk fails these writes too) becomes a note on `error`
        when the run is already failing with it; else the first such failure is raised."""

        def close_ledger() -> None:
            try:
                self.ledger.mark_pending("pending_at_exit", step=steps)
            finally:
                self.ledger.close()  # raises the ledger's write error, if it ever had one

        failures: list[tuple[str, Exception]] = []
        for what, close in (("the ledger", close_ledger), ("the metrics and trace files", self.obs.close)):
            try:
                close()
            except Exception as e:
                if e is not error:  # a ledger that failed with `error` raises it again
                    failures.append((what, e))
        if not failures:
            return
        first = error if error is not None else failures.pop(0)[1]
        for what, later in failures:
            log.error(f"closing {what} failed too", error=repr(later))
            first.add_note(f"also failed, closing {what}: {later!r}")
        if error is None:
            raise first

    # -- the step loop --------------------------------------------------------------------------------
    async def _step_loop(self, tg: asyncio.TaskGroup, summary: RunSummary) -> None:
        """The steps after `start_step` (the module docstring). A stop ends the loop between two steps:
        during a step's wait for its batch (`_StopRequested`: the step never begins), or after the step
        in progress (saved before its record); the newest finished step is saved, unless it is already."""
        self._last_step = summary.steps = self.start_step  # steps done, those resumed from included
        self._next_drain = self._start_drain(tg, self.start_step + 1)
        try:
            for step in range(self.start_step + 1, self.cfg.driver.num_rollout + 1):
                await self._step(tg, step, summary)
                self._last_step = step
                if self._stop_pending(done=step):
                    raise _StopRequested  # requested during the step, which ended saved and logged
        except _StopRequested:
            await self._save_at_stop(self._last_step)
        await self._pushed()  # a stop without --save may leave the last push in flight

    async def _step(self, tg: asyncio.TaskGroup, step: int, summary: RunSummary) -> None:
        """Step number `step` (`step` steps are done after it); `_StopRequested` when a stop cancels
        the wait for its batch."""
        clock = StepClock(asyncio.get_running_loop().time, since=self._times_read_at)
        self.ledger.flush()  # the previous step's fates reach the file (a failed write raises here)
        self.obs.begin_step(step, self.version)
        assert self._next_drain is not None
        with clock.phase("wait_data"):
            batch = await self._finish_drain(self._next_drain)
        self._next_drain = self._start_drain(tg, step + 1)
        groups = [it.group for it in batch]
        metrics = await self._batch_metrics(groups)
        metrics |= self.source.get_metrics()
        with clock.phase("train"):
            # the engines' load is read while the trainer works: its round trips (~4 ms, more when an
            # engine is busy) were part of every step when the record asked for it
            load = tg.create_task(self._engine_load(self._push), name=f"engine-load-step-{step}")
            metrics.update(await self.trainer.train(step, groups))
        with clock.phase("weight_sync"):
            await self._pushed()  # the push that ran alongside this training (its version is now behind)
        self._weights_ahead = True  # trained weights not pushed yet: a checkpoint now is one version on
        for item in batch:
            self.ledger.record("trained", item.group_index, step=step)
        if self._push_due(step):  # the run ends on pushed weights
            await self._push_after_barrier(tg, step, clock)
        stopping = self._stop_pending(step)
        if stopping or self._save_due(step) or self.evals.due(step) or step == self.cfg.driver.num_rollout:
            with clock.phase("weight_sync"):
                await self._pushed()  # a checkpoint, an eval point and the run's end read the pushed weights
        if stopping:
            await self._save_at_stop(step)  # saved before its metrics record, as every saved step
        elif self._save_due(step):
            await self.save(step)
        if not stopping and self.evals.due(step):
            with clock.phase("eval"):
                await self.evals.wait_before_push(steps_done=step)
            self.evals.dispatch(tg, steps_done=step, version=self.version or 0)
            self.obs.eval_dispatched(step)
        if step == self.cfg.driver.num_rollout:
            with clock.phase("eval"):
                await self.evals.wait_before_push(steps_done=step)  # the last point lands in the last record
        await self._record(step, groups, metrics, clock, summary, engine_load=await load)
        # the batch's items hold its groups: `_free` lets go of them a chunk at a time (`groups` goes with
        # this frame; a trainer may keep what it was given)
        tg.create_task(self._free(batch), name=f"free-batch-{step}")

    async def _engine_load(self, push: asyncio.Task[None] | None) -> dict[str, float]:
        """The engines' load for this step's record, read once `push` (the push running alongside this
        step's training, if any) is done: during it the engines are paused, or busy loading weights."""
        if push is not None:
            await asyncio.wait([push])  # its failure is its TaskGroup's to raise (see `_pushed`)
        return await self.obs.engine_load()

    @staticmethod
    async def _free(batch: list[BufferItem]) -> None:
        """Let go of a recorded batch, `METRICS_CHUNK_SAMPLES` samples at a time (what frees them is the
        last reference going: the batch is given to this task alone)."""
        share = LoopShare(METRICS_CHUNK_SAMPLES)
        while batch:
            if share.due(len(batch.pop().group)):
                await asyncio.sleep(0)

    async def _batch_metrics(self, groups: list[Group]) -> dict[str, float]:
        """The batch's rollout/* metrics against the current version, `METRICS_CHUNK_SAMPLES` samples at
        a time with the event loop let run between chunks (at 50,000 samples of long multi-version
        responses, the whole batch was a second of one callback: every rollout waited that long)."""
        version = self.version  # read once: an overlapped push may land between chunks
        stats, share = BatchStats(self.cfg.train.reward_key), LoopShare(METRICS_CHUNK_SAMPLES)
        for group in groups:
            stats.add(group)
            if share.due(len(group)):
                await asyncio.sleep(0)
        return stats.metrics(version)

    async def _push_after_barrier(self, tg: asyncio.TaskGroup, done: int, clock: StepClock) -> None:
        """Push the weights trained by `done` steps once every version is whole: the next step's batch is
        drained (at the current version) and the eval point in flight finished on the current weights.
        A stop that cancels that drain skips the push: the step ends unpushed (its checkpoint keeps the
        trained weights, one version ahead), then is saved and logged.

        The trainer stages the weights first, while the engines still generate (disk: rank 0 writes
        them), so the engines are paused only for their own part. With --overlap-weight-push, when that
        part needs nothing of the trainer (`stage_weights` says so), it runs as the task
        `weight-push-v<version>` alongside the next step's training, which no longer waits for the
        engines' pause, load and continue; `_pushed()` waits for it wherever the pushed weights are read."""
        if self._next_drain is not None:
            try:
                with clock.phase("wait_data"):
                    await self._finish_drain(self._next_drain)
            except _StopRequested:
                return
        with clock.phase("eval"):
            await self.evals.wait_before_push(steps_done=done)
        version = (self.version or 0) + 1
        with clock.phase("weight_sync"):
            with self.tracer.slice("stage weights", track="trainer", version=version):
                staged = await self.trainer.stage_weights(version=version)
            if not (staged and self.cfg.driver.overlap_weight_push):
                await self._push_weights(version)
                return
        self._push = tg.create_task(self._push_weights(version), name=f"weight-push-v{version}")

    async def _pushed(self) -> None:
        """Wait for the push running alongside training, if any. Its failure is its TaskGroup's to
        raise: the group cancels this wait, so the error is reported once."""
        push, self._push = self._push, None
        if push is not None:
            await asyncio.wait([push])

    async def _record(
        self,
        step: int,
        groups: list[Group],
        metrics: dict[str, float],
        clock: StepClock,
        summary: RunSummary,
        *,
        engine_load: dict[str, float],
    ) -> None:
        """The step's record: its metrics, its drain's buffer window, perf/* from its clock, the engines'
        load read during its training, eval points."""
        times = clock.times()
        self._times_read_at = clock.since + times.step_s  # the next step's time starts here
        metrics |= self._drained_metrics.pop(step) | self.accounting.step_metrics(
            times, now=asyncio.get_running_loop().time(), trained_tokens=int(metrics["rollout/tokens"])
        )
        metrics["perf/weight_push_seconds"] = self._push_s
        metrics = await self.obs.end_step(
            step,
            groups,
            metrics,
            evals=self.evals.collect(),
            times=times,
            start=clock.start,
            train_start=clock.began["train"],
            engine_load=engine_load,
        )
        summary.steps, summary.last_metrics = step, metrics
        summary.step_times_s.append(times.step_s)

    def _push_due(self, done: int) -> bool:
        """Every --update-weights-interval steps, and after the last one."""
        d = self.cfg.driver
        return done % d.update_weights_interval == 0 or done == d.num_rollout

    def _save_due(self, done: int) -> bool:
        """With --save and --save-interval: every interval, and after the last step."""
        d = self.cfg.driver
        if not d.save_interval or d.save is None:
            return False
        return done % d.save_interval == 0 or done == d.num_rollout

    def _stop_pending(self, done: int) -> bool:
        """A stop was requested and steps remain (a stop during the last step is just the end)."""
        return self._stop.is_set() and done < self.cfg.driver.num_rollout

    @property
    def steps_done(self) -> int:
        """The steps trained so far, counting those of the checkpoint the run resumed from."""
        return self._last_step

    @property
    def last_checkpoint_step(self) -> int | None:
        """The N of the newest complete checkpoint `step_N` of this run: saved by it, else the one it
        resumed from; None if there is none (what a stop that skips its save leaves `--load` to resume
        from)."""
        return self._saved_step if self._saved_step >= 0 else None

    @property
    def last_checkpoint_dir(self) -> Path | None:
        """The directory of `last_checkpoint_step` (None without one)."""
        return self._saved_dir

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint (with --save), and return (SIGINT/SIGTERM)."""
        log.warning("stop requested: finishing the current step")
        self._stop.set()
        if self._next_drain is not None:
            self._next_drain.cancel()  # waiting for data ends now; what it drained is kept for the save

    async def _save_at_stop(self, last_step: int) -> None:
        """The run stops after step `last_step`: save it (with --save), unless it is saved already."""
        self.stopped = True
        if self.cfg.driver.save is not None and last_step > 0 and last_step != self._saved_step:
            await self.save(last_step)

    # -- the producer and the drains -------------------------------------------------------------------
    async def _supervise_worker(self) -> None:
        """Run the worker; keep its error for the drain, which re-raises it (with its own traceback)."""
        try:
            await self.worker.run()
        except Exception as e:
            self._worker_error = primary_error(e)  # its siblings (other groups that raised) become notes
            log.error("rollout worker died", error=repr(self._worker_error))
        finally:
            self.buffer.close()

    def _start_drain(self, tg: asyncio.TaskGroup, step: int) -> asyncio.Task[list[BufferItem]] | None:
        """Start draining `step`'s batch (one step ahead of training); None past the last step."""
        if step > self.cfg.driver.num_rollout:
            return None
        return tg.create_task(self._drain(step), name=f"drain-{step}")

    async def _finish_drain(self, drain: asyncio.Task[list[BufferItem]]) -> list[BufferItem]:
        """The drain's batch; `_StopRequested` if `request_stop()` cancelled it (what it had taken stays
        in `_draining`, for the checkpoint)."""
        try:
            return await drain
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stop.is_set() and drain.cancelled() and task is not None and not task.cancelling():
                raise _StopRequested from None
            raise

    async def _drain(self, step: int) -> list[BufferItem]:
        """Take rollout_batch_size groups from the buffer for `step`, sorted by sample index."""
        need = self.cfg.rollout.rollout_batch_size
        batch = self._draining  # kept on self: a stop that cancels this drain saves what it holds
        while self._carry and len(batch) < need:  # restored from a checkpoint: drained, never trained
            item = self._carry.pop(0)
            self._consumed(item)
            batch.append(item)
        share = LoopShare(METRICS_CHUNK_SAMPLES)
        while len(batch) < need:
            self._raise_if_worker_died(step)
            try:
                async with asyncio.timeout(self.cfg.driver.stall_warning_s):
                    item = await self.buffer.get(current_version=self.version)
            except TimeoutError:
                log.warning(
                    f"No completed rollout groups for {self.cfg.driver.stall_warning_s}s",
                    step=step,
                    have=len(batch),
                    need=need,
                    in_flight_groups=self.gate.state.in_flight_groups,
                )
                if isinstance(self.engine.inner, EngineRouter):  # fakes in tests have no fleet to probe
                    await self.engine.inner.probe_stalled()  # excludes an engine that stopped answering
                continue
            except BufferClosed:
                if self._worker_error is None:
                    raise
                continue  # the worker died: its error is raised at the top, outside this handler
            self._consumed(item)
            batch.append(item)
            if share.due(len(item.group)) and len(batch) < need:
                # a full buffer's groups come without a wait: a step's worth (and the wake-ups of the
                # producers each pop makes room for) in one callback held the loop for 10+ ms at 50,000
                # in flight; what was taken is in `_draining` if a stop cancels the wait
                await asyncio.sleep(0)
        self._draining = []
        self._drained_metrics[step] = self.buffer.get_metrics()  # consumed staleness etc. of this batch
        return sorted(batch, key=lambda it: min(s.index for s in it.group))

    def _consumed(self, item: BufferItem) -> None:
        """A group drained for training: admission counts it consumed, its recycle count is done with."""
        self.gate.on_consumed(item.group_index)
        self.fates.forget(item.group_index)

    def _raise_if_worker_died(self, step: int) -> None:
        """Raise the dead worker's own error (the user's exception, say): this batch can never be
        complete. A note names the step; the traceback is the worker's."""
        error = self._worker_error
        if error is None:
            return
        note = f"raised in the rollout worker, which died before step {step}'s batch was complete"
        if note not in getattr(error, "__notes__", ()):
            error.add_note(note)
        raise error

    # -- weights and checkpoints -----------------------------------------------------------------------
    async def _push_weights(self, version: int) -> None:
        """pause → flush (unless in_place) → transfer → stamp the version → continue → publish."""
        mode, tr = self.cfg.driver.pause_generation_mode, self.tracer
        t0 = asyncio.get_running_loop().time()
        with tr.slice("push weights", track="weights", version=version):
            with tr.slice("pause", track="weights", mode=mode):
                await self.engine.pause_generation(mode)
                fault_point("push:paused")
                if mode != "in_place":
                    await self.engine.flush_cache()
                    fault_point("push:flushed")
            with tr.slice("transfer", track="weights"):
                # the router's side of the transfer has its points too (push:weights_written, push:broadcast)
                await self.trainer.sync_weights(self.engine.inner, version=version)
                fault_point("push:transferred")
                await self.engine.update_weight_version(version)
                fault_point("push:stamped")
            with tr.slice("continue", track="weights"):
                await self.engine.continue_generation()
                fault_point("push:continued")  # the engines generate with it; the controller not told yet
        self._weights_ahead = False
        self.version = version
        self.gate.publish_version(version)
        self.obs.version_pushed(version)
        self._push_s = asyncio.get_running_loop().time() - t0

    async def save(self, step: int) -> None:
        """`step_<step>` (the weights after `step` steps): trainer state plus everything the controller
        needs to resume without losing a group."""
        assert self.cfg.driver.save is not None
        await self._pushed()  # the checkpoint's version is the pushed one
        carry = await self._batch_to_carry()
        # The commit order (see miles_aio.checkpoint): every file, fsynced, then `latest` last. A crash
        # or a failed write at any point before `latest` leaves the previous checkpoint the resumable one.
        save_dir = self.cfg.driver.save
        directory = prepare_step_dir(save_dir, step)
        fault_point("save:begin")
        await self.trainer.save(step, directory)  # the trainer's files, fsynced
        if self.cfg.eval.save_hf is not None:  # eval modes 2/3 may reuse it as their snapshot
            await save_hf_checkpoint(self.trainer, self.cfg.eval.save_hf, step)
        fault_point("save:trainer_saved")
        # no await from here on: the state, the ledger's open groups and its marker are one instant
        in_flight = self.worker.pending_prompt_groups()
        marker = self.ledger.checkpoint(step)  # written and fsynced
        fault_point("save:ledger_marked")
        state = ControllerState(
            steps_done=step,
            version=(self.version or 0) + int(self._weights_ahead),
            data_source=self.source.state_dict(),
            buffer=self.buffer.state_dict(),
            carry=carry,
            in_flight=in_flight,
            ledger_checkpoint=marker,
        )
        write_controller_state(save_dir, state)
        fault_point("save:state_written")
        publish_latest(save_dir, step)  # the commit point
        fault_point("save:latest_published")
        self._saved_step, self._saved_dir, self.saved_this_run = step, directory, True
        log.info("saved checkpoint", step=step, path=str(directory))

    async def _batch_to_carry(self) -> list[BufferItem]:
        """The next step's batch, saved as `carry`: its drain finished first, so that it is saved whole
        (unless a stop cancelled it: then whatever the drain had taken)."""
        drain = self._next_drain
        if drain is not None and not drain.cancelled():
            try:
                return list(await self._finish_drain(drain))
            except _StopRequested:
                pass
        return list(self._draining)

    async def _restore(self, load: Path) -> None:
        """Continue from a checkpoint: weights, data position, buffered, drained and in-flight groups."""
        directory = latest_checkpoint(load)
        state = read_controller_state(directory)
        await self.trainer.load(directory)
        self.source.load_state_dict(state.data_source)
        self.buffer.load_state_dict(state.buffer)
        self._carry = list(state.carry)
        self.start_step, self.version = state.steps_done, state.version
        self._last_step = state.steps_done
        restored = [*self._carry, *buffered_items(state.buffer)]
        self.worker.restore(restored, state.in_flight, start_step=self.start_step, version=self.version)
        self.ledger.resume(
            state.marker_step,
            {it.group_index for it in restored} | {g[0].group_index for g in state.in_flight},
            checkpoint=state.ledger_checkpoint,
        )
        # a stop before the next step must not re-save (overwrite) it
        self._saved_step, self._saved_dir = state.steps_done, directory
        log.info(
            "resumed",
            from_step=state.steps_done,
            next_step=state.steps_done + 1,
            version=self.version,
            carry=len(self._carry),
            path=str(directory),
        )

"""The controller: one event loop, one TaskGroup, the driver step loop of a fully async RL run.

    DataSource ─► RolloutWorker ─(admit)─► RolloutPool ─► DataBuffer.put ┐
       ▲ recycle        ▲ versions, consumed/discarded                    │
       └── on_unused ◄──┴────────────── DataBuffer.get ◄── drain ◄────────┘
                                                           │
       step loop:  drain(B groups) ─► Trainer.train ─► every I steps: pause → sync → stamp → continue

Tasks (all owned by `run()`'s TaskGroup):
  rollout-worker  produces finished groups into the buffer; never waits for training.
                  Waits for admission (in-flight bound, full buffer, pacing); unblocked by group
                  completion, consumption and new versions.
  drain-<step>    consumes B groups from the buffer for one step (one step ahead of training);
                  waits for `buffer.get()`; unblocked by the worker's puts. The push after step s waits
                  for the drain of step s+1 to finish, so a batch is drained at a single version.
  agent-sessions  with --custom-agent-function-path only: the agents' OpenAI-compatible session endpoint
                  (`miles_aio.rollout.agent.SessionServer`); answers agents until cancelled at the end.
  the body        the step loop: trains, pushes weights, saves, evaluates, logs metrics.

Shutdown (healthy): after the last step the worker is cancelled; in-flight groups are recorded
`pending_at_exit` in the ledger. Stop (`request_stop()`, on SIGINT/SIGTERM): the step in progress
finishes (a wait for data ends at once; its weight push is skipped when it would first wait for the
next batch), a checkpoint with every pending group is saved, the step's metrics record is written, then
as healthy. Crash: a worker exception is kept, the buffer closed, and the next drain raises
`RolloutWorkerDied` from it; any other failing task cancels the group and its error propagates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

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
from miles_aio.errors import BufferClosed, RolloutWorkerDied, primary_error
from miles_aio.eval.build import build_eval_dispatcher
from miles_aio.eval.dispatcher import EvalPoints
from miles_aio.eval.snapshots import save_hf_checkpoint
from miles_aio.inference.base import InferenceEngine
from miles_aio.ledger import Ledger
from miles_aio.metrics import MetricsSink, rollout_batch_metrics
from miles_aio.observability.accounting import StepAccounting, StepTimes
from miles_aio.observability.observer import RunObserver
from miles_aio.plugins import Plugins
from miles_aio.rollout.agent import agent_sessions
from miles_aio.rollout.context import LimitedEngine, RolloutContext, Tokenizer
from miles_aio.rollout.limiter import Limiter
from miles_aio.rollout.pool import RolloutPool
from miles_aio.scheduler.adaptive import run_adaptive
from miles_aio.scheduler.policy import AdmissionLimits, DrainSchedule
from miles_aio.scheduler.worker import RolloutWorker
from miles_aio.trainer.base import Trainer
from miles_aio.types import RunSummary

__all__ = ["Controller", "RunSummary"]

log = structlog.get_logger("miles_aio.controller")


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
        self.version: int | None = None
        self._worker_error: BaseException | None = None
        self.start_step = 0
        self.stopped = False
        self._weights_ahead = False
        self._carry: list[BufferItem] = []  # drained before a checkpoint, not yet trained: consumed first
        self._next_drain: asyncio.Task[list[BufferItem]] | None = None
        self._draining: list[BufferItem] = []  # groups the current drain has taken so far
        self._saved_step = -1  # a stop right after a periodic save does not save the same step again
        self._drained_metrics: dict[int, dict[str, float]] = {}  # buffer window of each step's drain
        self._stop = asyncio.Event()
        ledger_path = cfg.run_dir / "ledger.jsonl" if write_files else None
        self.ledger = Ledger(ledger_path, dataset_size=source.dataset_size)
        self.obs = RunObserver(cfg, engine, sinks=sinks, write_files=write_files)
        self.sinks, self.tracer = self.obs.sinks, self.obs.tracer  # metrics sinks; timeline trace
        self.limiter = Limiter(cfg.rollout.sglang_server_concurrency * num_engines)
        self.engine = LimitedEngine(engine, self.limiter, tracer=self.tracer)
        self.ctx = RolloutContext(
            engine=self.engine,
            tokenizer=tokenizer,
            config=cfg,
            log=structlog.get_logger("miles_aio.rollout"),
            sessions=agent_sessions(cfg, tokenizer),  # the agent session endpoint, with an agent (else None)
        )
        self.buffer: DataBuffer = plugins.buffer_cls(
            DataBufferContext(
                config=cfg,
                on_unused=lambda item, why: self.fates.on_unused(item, why),
                on_filtered=lambda item, why: self.fates.on_filtered(item, why),
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
            limits=AdmissionLimits(
                max_in_flight_samples=cfg.max_in_flight_samples,
                group_size=cfg.rollout.n_samples_per_prompt,
                granularity=cfg.scheduler.rollout_submission_granularity,
                max_admission_staleness=cfg.scheduler.max_admission_staleness,
                schedule=DrainSchedule(
                    batch_groups=cfg.rollout.rollout_batch_size,
                    update_interval=cfg.driver.update_weights_interval,
                ),
            ),
            source=source,
            pool=self.pool,
            buffer=self.buffer,
            ledger=self.ledger,
        )
        self.obs.watch(self.buffer, self.worker.state)  # buffer depth, in-flight samples and groups
        self.accounting = StepAccounting(
            blocked_seconds=self.worker.blocked_seconds, generated_tokens=lambda: self.engine.generated_tokens
        )
        self.evals: EvalPoints = evals or build_eval_dispatcher(
            cfg,
            controller_ctx=self.ctx,
            plugins=plugins,
            trainer=trainer,
            eval_datasets=eval_datasets,
            eval_engine=eval_engine,
        )
        self.fates = GroupFates(
            handler=cfg.buffer.async_unused_samples_handler,
            failure_policy=cfg.rollout.rollout_failure_policy,
            max_recycles=cfg.buffer.max_group_recycles,
            discard=self.worker.on_discarded,
            ledger=self.ledger,
            source=source,
            accounting=self.accounting,
        )
        self.worker.consumed_hooks.append(self.fates.forget)

    # -- the run ---------------------------------------------------------------------------------------
    async def run(self) -> RunSummary:
        summary = RunSummary()
        t0 = time.monotonic()
        try:
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
                tg.create_task(run_adaptive(self, worker), name="adaptive-concurrency")  # `auto` only
                try:
                    await self._step_loop(tg, summary)
                finally:
                    worker.cancel()
                    if serving is not None:
                        serving.cancel()
        except BaseException as e:
            error = primary_error(e)
            self._close_files(summary.steps, error)
            if error is e:
                raise
            raise error  # noqa: B904 - keep the primary error's own cause chain
        self._close_files(summary.steps, None)
        summary.version = self.version
        summary.wall_s = time.monotonic() - t0
        summary.ledger_counts = dict(self.ledger.counts)
        return summary

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

    async def _step_loop(self, tg: asyncio.TaskGroup, summary: RunSummary) -> None:
        cfg, loop, wait_eval = self.cfg.driver, asyncio.get_running_loop(), self.evals.wait_before_push
        n, first = cfg.num_rollout, self.start_step
        self._next_drain = tg.create_task(self._drain(first), name=f"drain-{first}") if first < n else None
        for step in range(first, n):
            t_step = loop.time()
            self.ledger.flush()  # the previous step's fates reach the file (a failed write raises here)
            self.obs.begin_step(step, self.version)
            assert self._next_drain is not None
            if not await self._await_drain(self._next_drain):
                await self._stop_now(step - 1)
                return
            batch = self._next_drain.result()
            wait_data = loop.time() - t_step
            self._next_drain = (
                tg.create_task(self._drain(step + 1), name=f"drain-{step + 1}") if step + 1 < n else None
            )
            groups, key = [it.group for it in batch], self.cfg.train.reward_key
            metrics = rollout_batch_metrics(groups, version=self.version, reward_key=key)
            metrics |= self.source.get_metrics()
            t_train = loop.time()
            metrics.update(await self.trainer.train(step, groups))
            self._weights_ahead = True  # trained weights not pushed yet: a checkpoint now is one version on
            for item in batch:
                self.ledger.record("trained", item.group_index, step=step)
            train_s = loop.time() - t_train
            sync_s, eval_s, done, stopping = 0.0, 0.0, step + 1, False
            if done % cfg.update_weights_interval == 0 or done == n:  # the run ends on pushed weights
                if self._next_drain is not None:
                    t_wait = loop.time()
                    # one version per batch: drain first; a stop cancels that wait, and the step then ends
                    # unpushed (the checkpoint keeps its weights, one version ahead) but logged
                    stopping = not await self._await_drain(self._next_drain)
                    wait_data += loop.time() - t_wait
                if not stopping:
                    eval_s += await wait_eval(steps_done=done)  # an eval point sees one version too
                    t_sync = loop.time()
                    await self._push_weights((self.version or 0) + 1)
                    sync_s = loop.time() - t_sync
            stopping = stopping or (self._stop.is_set() and done < n)
            if stopping:
                await self._stop_now(step)  # saved before its metrics record, as every saved step
            elif cfg.save_interval and cfg.save and (done % cfg.save_interval == 0 or done == n):
                await self.save(step)
            if not stopping and self.evals.due(done):
                eval_s += await wait_eval(steps_done=done)
                self.evals.dispatch(tg, steps_done=done, version=self.version or 0)
                self.obs.eval_dispatched(done)
            if done == n:
                eval_s += await wait_eval(steps_done=done)  # the last point lands in the last record
            times = StepTimes(
                step_s=loop.time() - t_step,
                wait_data_s=wait_data,
                train_s=train_s,
                weight_sync_s=sync_s,
                eval_s=eval_s,
            )
            metrics |= self._drained_metrics.pop(step) | self.accounting.step_metrics(
                times, now=loop.time(), trained_tokens=int(metrics["rollout/tokens"])
            )
            metrics = await self.obs.end_step(
                step,
                groups,
                metrics,
                evals=self.evals.collect(),
                times=times,
                start=t_step,
                train_start=t_train,
            )
            summary.steps, summary.last_metrics = step + 1, metrics
            summary.step_times_s.append(times.step_s)
            if stopping:
                return
            if self._stop.is_set() and done < n:  # requested while the record was written
                await self._stop_now(step)
                return

    @property
    def last_checkpoint_step(self) -> int | None:
        """The step of the newest complete checkpoint of this run: saved by it, else the one it resumed
        from; None if there is none (what a stop that skips its save leaves `--load` to resume from)."""
        if self._saved_step >= 0:
            return self._saved_step
        return self.start_step - 1 if self.cfg.driver.load is not None else None

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint (with --save), and return (SIGINT/SIGTERM)."""
        log.warning("stop requested: finishing the current step")
        self._stop.set()
        if self._next_drain is not None:
            self._next_drain.cancel()  # waiting for data ends now; what it drained is kept for the save

    async def _await_drain(self, drain: asyncio.Task[list[BufferItem]]) -> bool:
        """Wait for a drain; False if `request_stop()` cancelled it (its groups stay in `_draining`)."""
        try:
            await drain
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stop.is_set() and drain.cancelled() and task is not None and not task.cancelling():
                return False
            raise
        return True

    async def _stop_now(self, last_step: int) -> None:
        self.stopped = True
        if self.cfg.driver.save is not None and last_step >= 0 and last_step != self._saved_step:
            await self.save(last_step)

    async def _supervise_worker(self) -> None:
        """Run the worker; keep its error for the drain (loud, with the original traceback)."""
        try:
            await self.worker.run()
        except Exception as e:
            self._worker_error = primary_error(e) if isinstance(e, BaseExceptionGroup) else e
            log.error("rollout worker died", error=repr(self._worker_error))
        finally:
            self.buffer.close()

    async def _drain(self, step: int) -> list[BufferItem]:
        """Take rollout_batch_size groups from the buffer for `step`, sorted by sample index."""
        need = self.cfg.rollout.rollout_batch_size
        batch = self._draining  # kept on self: a stop that cancels this drain saves what it holds
        while self._carry and len(batch) < need:  # restored from a checkpoint: drained, never trained
            item = self._carry.pop(0)
            self.worker.on_consumed(item.group_index)
            batch.append(item)
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
                    in_flight_groups=self.worker.state.in_flight_groups,
                )
                continue
            except BufferClosed:
                self._raise_if_worker_died(step)
                raise
            self.worker.on_consumed(item.group_index)
            batch.append(item)
        self._draining = []
        self._drained_metrics[step] = self.buffer.get_metrics()  # consumed staleness etc. of this batch
        return sorted(batch, key=lambda it: min(s.index for s in it.group))

    def _raise_if_worker_died(self, step: int) -> None:
        if self._worker_error is not None:
            raise RolloutWorkerDied(f"the rollout worker died before step {step}'s batch was complete") from (
                self._worker_error
            )

    async def _push_weights(self, version: int) -> None:
        """pause → flush (unless in_place) → transfer → stamp the version → continue → publish."""
        mode, tr = self.cfg.driver.pause_generation_mode, self.tracer
        with tr.slice("push weights", track="trainer", version=version):
            with tr.slice("pause", track="trainer", mode=mode):
                await self.engine.pause_generation(mode)
                fault_point("push:paused")
                if mode != "in_place":
                    await self.engine.flush_cache()
                    fault_point("push:flushed")
            with tr.slice("transfer", track="trainer"):
                # the router's side of the transfer has its points too (push:weights_written, push:broadcast)
                await self.trainer.sync_weights(self.engine.inner, version=version)
                fault_point("push:transferred")
                await self.engine.update_weight_version(version)
                fault_point("push:stamped")
            with tr.slice("continue", track="trainer"):
                await self.engine.continue_generation()
                fault_point("push:continued")  # the engines generate with it; the controller not told yet
        self._weights_ahead = False
        self.version = version
        self.worker.publish_version(version)
        self.obs.version_pushed(version)

    async def save(self, step: int) -> None:
        """Trainer state plus everything the controller needs to resume without losing a group."""
        assert self.cfg.driver.save is not None
        # The batch for step+1 may be half-drained: finish it so that it is saved whole, as `carry`
        # (unless stopping: then whatever the cancelled drain had taken is the carry).
        drain = self._next_drain
        if drain is not None and (drain.cancelled() or not await self._await_drain(drain)):
            drain = None
        carry = list(drain.result()) if drain is not None else list(self._draining)
        # The commit order (see miles_aio.checkpoint): every file, fsynced, then `latest` last. A crash
        # or a failed write at any point before `latest` leaves the previous checkpoint the resumable one.
        save_dir = self.cfg.driver.save
        directory = prepare_step_dir(save_dir, step)
        fault_point("save:begin")
        await self.trainer.save(step, directory)  # the trainer's files, fsynced
        if self.cfg.eval.save_hf is not None:  # eval modes 2/3 may reuse it as their snapshot
            await save_hf_checkpoint(self.trainer, self.cfg.eval.save_hf, step + 1)
        fault_point("save:trainer_saved")
        # no await from here on: the state, the ledger's open groups and its marker are one instant
        in_flight = self.worker.pending_prompt_groups()
        marker = self.ledger.checkpoint(step)  # written and fsynced
        fault_point("save:ledger_marked")
        state = ControllerState(
            step=step,
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
        self._saved_step = step
        log.info("saved checkpoint", step=step, path=str(directory))

    async def _restore(self, load: Path) -> None:
        """Continue from a checkpoint: weights, data position, buffered, drained and in-flight groups."""
        directory = latest_checkpoint(load)
        state = read_controller_state(directory)
        await self.trainer.load(directory)
        self.source.load_state_dict(state.data_source)
        self.buffer.load_state_dict(state.buffer)
        self._carry = list(state.carry)
        self.start_step, self.version = state.step + 1, state.version
        restored = [*self._carry, *buffered_items(state.buffer)]
        self.worker.restore(restored, state.in_flight, start_step=self.start_step, version=self.version)
        self.ledger.resume(
            state.step,
            {it.group_index for it in restored} | {g[0].group_index for g in state.in_flight},
            checkpoint=state.ledger_checkpoint,
        )
        self._saved_step = state.step  # a stop before the next step must not re-save (overwrite) it
        log.info(
            "resumed", from_step=state.step, version=self.version, carry=len(self._carry), path=str(directory)
        )

"""`build_eval_dispatcher`: the run's eval backend from its config (called by the Controller).

  mode 1  (default)               `EvalDispatcher(SharedEngineEval)` on the rollout engines
  mode 2  --eval-sglang-urls/--eval-num-gpus   `SnapshotEvalDispatcher(DedicatedEngineEval)` on the
                                  fleet that the recipe opened with `open_eval_engines` (`eval_engine`)
  mode 3  --eval-function-path    `SnapshotEvalDispatcher(ExternalEval)`
Modes 2 and 3 take snapshots from `snapshot_source` (--eval-hf-dir export, or --save-hf reuse).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import structlog

from miles_aio.config import RunConfig
from miles_aio.data.source import PromptRecord
from miles_aio.eval.dispatcher import EvalDispatcher, EvalPoints, NoEval
from miles_aio.eval.external import ExternalEval, load_eval_fn
from miles_aio.eval.fleet import DedicatedEngineEval, EvalFleet
from miles_aio.eval.shared import EVAL_PRIORITY, SharedEngineEval
from miles_aio.eval.snapshot_dispatcher import SnapshotEvalDispatcher, SnapshotEvaluator
from miles_aio.eval.snapshots import snapshot_source
from miles_aio.inference.base import InferenceEngine
from miles_aio.plugins import Plugins
from miles_aio.rollout.context import LimitedEngine, RolloutContext

__all__ = ["build_eval_dispatcher"]

log = structlog.get_logger("miles_aio.eval")


def build_eval_dispatcher(
    cfg: RunConfig,
    *,
    controller_ctx: RolloutContext,
    plugins: Plugins,
    trainer: object,
    eval_datasets: Mapping[str, Sequence[PromptRecord]] | None,
    eval_engine: InferenceEngine | None = None,
) -> EvalPoints:
    """The dispatcher for `cfg`'s eval mode (`NoEval` when there is nothing to evaluate).

    `controller_ctx` is the rollout context (mode 1 queues above rollout on its limited engine);
    `eval_engine` is the mode-2 fleet's router; `trainer` exports the snapshots (`export_hf`).
    Raises ConfigError (bad --eval-function-path, a trainer without `export_hf`) or RuntimeError (mode
    2 without a fleet).
    """
    ev, datasets = cfg.eval, dict(eval_datasets or {})
    if not ev.uses_snapshots:
        if not datasets:
            return NoEval()
        engine = controller_ctx.engine
        if isinstance(engine, LimitedEngine):
            engine = engine.with_priority(EVAL_PRIORITY)
        return EvalDispatcher(
            SharedEngineEval(
                ctx=replace(controller_ctx, engine=engine),
                datasets=datasets,
                generate_fn=plugins.generate_fn,
                reward_fn=plugins.reward_fn,
                n_samples_per_prompt=ev.n_samples_per_eval_prompt,
                max_response_len=ev.eval_max_response_len,
                temperature=ev.eval_temperature,
            ),
            interval=cfg.driver.eval_interval,
            final_step=cfg.driver.num_rollout,
            before_train=not ev.skip_eval_before_train,
        )
    evaluator: SnapshotEvaluator
    if ev.dedicated_engines:
        if eval_engine is None:
            raise RuntimeError("eval mode 2 needs its engines: enter open_eval_engines(cfg) and pass them")
        if not isinstance(eval_engine, EvalFleet):
            raise TypeError(
                f"eval mode 2 needs its engines as an EngineRouter (open_eval_engines), got "
                f"{type(eval_engine).__name__}: each point is pinned and verified engine by engine"
            )
        if not datasets:
            log.warning("eval mode 2 without eval datasets: nothing to evaluate")
            return NoEval()
        n_engines = len(ev.eval_sglang_urls) or ev.eval_num_gpus // ev.eval_num_gpus_per_engine
        evaluator = DedicatedEngineEval(
            engine=eval_engine,
            ctx=controller_ctx,
            datasets=datasets,
            generate_fn=plugins.generate_fn,
            reward_fn=plugins.reward_fn,
            concurrency=cfg.rollout.sglang_server_concurrency * n_engines,
            ready_timeout_s=cfg.engine.engine_admin_timeout_s,
        )
    else:
        evaluator = ExternalEval(load_eval_fn(cfg), config=cfg, datasets=datasets)
    return SnapshotEvalDispatcher(
        evaluator,
        snapshot_source(cfg, trainer),
        interval=cfg.driver.eval_interval,
        final_step=cfg.driver.num_rollout,
        before_train=not ev.skip_eval_before_train,
        max_in_flight=ev.eval_max_in_flight,
        overflow_policy=ev.eval_overflow_policy,
        keep_snapshots=ev.eval_keep_snapshots,
    )

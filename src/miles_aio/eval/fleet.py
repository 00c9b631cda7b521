"""Mode 2: dedicated eval engines that load HF snapshots (`update_weights_from_disk`).

`open_eval_engines(cfg, model_path=...)` is the fleet's owner: an async context manager (entered by the
recipe next to the rollout engines) that yields one `EngineRouter` over the eval engines, or None when
mode 2 is off. It uses `--eval-sglang-urls` as they are, or starts `--eval-num-gpus /
--eval-num-gpus-per-engine` engines (embedded CPU engines with the local backend, SGLang servers on the
GPUs after the trainer's and the rollout engines' with the sglang backend) and stops them on every exit
path. The fleet never joins the rollout engines' weight pushes: it loads each point's snapshot.

`DedicatedEngineEval` is the mode-2 evaluator of `SnapshotEvalDispatcher`: per point it loads the
snapshot as the point's version on every eval engine, then generates the eval datasets there exactly as
mode 1 does (`SharedEngineEval`, same `eval/<ds>/*` metrics), behind its own limiter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path

from miles_aio.config import RunConfig
from miles_aio.data.source import PromptRecord
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.engines import api_key_args
from miles_aio.inference.router import EngineRouter
from miles_aio.rollout.context import LimitedEngine, RolloutContext
from miles_aio.rollout.limiter import Limiter
from miles_aio.rollout.pool import GenerateFn, RewardFn
from miles_aio.types import Sample

__all__ = ["DedicatedEngineEval", "open_eval_engines"]


class DedicatedEngineEval:
    def __init__(
        self,
        *,
        engine: InferenceEngine,
        ctx: RolloutContext,
        datasets: Mapping[str, Sequence[PromptRecord]],
        generate_fn: GenerateFn,
        reward_fn: RewardFn | None,
        concurrency: int,
    ) -> None:
        from miles_aio.eval.shared import SharedEngineEval

        self.engine = engine
        ev = ctx.config.eval
        self._eval = SharedEngineEval(
            ctx=replace(ctx, engine=LimitedEngine(engine, Limiter(concurrency))),
            datasets=datasets,
            generate_fn=generate_fn,
            reward_fn=reward_fn,
            n_samples_per_prompt=ev.n_samples_per_eval_prompt,
            max_response_len=ev.eval_max_response_len,
            temperature=ev.eval_temperature,
        )

    @property
    def last_samples(self) -> dict[str, list[Sample]]:
        """The samples of the last point, by dataset."""
        return self._eval.last_samples

    async def evaluate_snapshot(self, snapshot: Path, *, step: int, version: int) -> dict[str, float]:
        """Consumes: the snapshot dir. Waits for: every eval engine to load it. Produces: eval/<ds>/*."""
        await self.engine.update_weights_from_disk(str(snapshot), version=version)
        return await self._eval.evaluate()


@asynccontextmanager
async def open_eval_engines(
    cfg: RunConfig,
    *,
    model_path: Path | None = None,
    trainer: object = None,
    sglang_args: Sequence[str] = (),
) -> AsyncIterator[EngineRouter | None]:
    """The mode-2 eval fleet as one router (None unless mode 2); started engines stop on exit.

    Launched engines start from `model_path`, else `--hf-checkpoint`, else the trainer's current weights
    exported to `<run-dir>/eval_engine_init`; each eval point replaces those weights with its snapshot.
    """
    ev, e = cfg.eval, cfg.engine
    if not ev.dedicated_engines:
        yield None
        return
    from miles_aio.eval.snapshots import HFExporter, snapshot_root

    async with AsyncExitStack() as stack:
        if ev.eval_sglang_urls:
            urls = list(ev.eval_sglang_urls)
        else:
            start_from = model_path or cfg.train.hf_checkpoint
            if start_from is None and isinstance(trainer, HFExporter):
                start_from = await trainer.export_hf(cfg.run_dir / "eval_engine_init")
            if start_from is None:
                raise RuntimeError("eval engines need a model to start from: model_path or --hf-checkpoint")
            n = ev.eval_num_gpus // ev.eval_num_gpus_per_engine
            if e.rollout_backend == "sglang":
                from miles_aio.inference.sglang_launch import launch_sglang_servers

                t = cfg.train
                urls = await stack.enter_async_context(
                    launch_sglang_servers(
                        start_from,
                        num_engines=n,
                        gpus_per_engine=ev.eval_num_gpus_per_engine,
                        gpu_offset=t.actor_num_nodes * t.actor_num_gpus_per_node + e.rollout_num_gpus,
                        extra_args=[*sglang_args, *api_key_args(e.sglang_api_key)],
                        log_dir=cfg.run_dir / "logs" / "eval",
                    )
                )
            else:
                from miles_aio.inference.local_launch import launch_local_engines

                urls = await stack.enter_async_context(
                    launch_local_engines(
                        start_from,
                        num_engines=n,
                        weights_root=snapshot_root(cfg),
                        num_threads=e.engine_num_threads,
                        log_dir=cfg.run_dir / "logs" / "eval",
                        api_key=e.sglang_api_key,
                    )
                )
        yield await stack.enter_async_context(EngineRouter.open(urls, api_key=e.sglang_api_key))

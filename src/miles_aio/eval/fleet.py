"""Mode 2: dedicated eval engines that load HF snapshots (`update_weights_from_disk`).

`open_eval_engines(cfg, model_path=...)` is the fleet's owner: an async context manager (entered by the
recipe next to the rollout engines) that yields one `EngineRouter` over the eval engines, or None when
mode 2 is off. It uses `--eval-sglang-urls` as they are, or starts `--eval-num-gpus /
--eval-num-gpus-per-engine` engines (embedded CPU engines with the local backend, SGLang servers on the
GPUs after the trainer's and the rollout engines' with the sglang backend) and stops them on every exit
path. The fleet never joins the rollout engines' weight pushes: it loads each point's snapshot.

`DedicatedEngineEval` is the mode-2 evaluator of `SnapshotEvalDispatcher`: per point it pins the
snapshot, as the point's version, on every eval engine, then generates the eval datasets there exactly
as mode 1 does (`SharedEngineEval`, same `eval/<ds>/*` metrics), behind its own limiter.

Pinning is all-or-nothing across the fleet, so a point never mixes weights:
  1. health   `/health_generate` on every engine; all of them must be in rotation within the ready
              timeout (`--engine-admin-timeout-s`), else the point is skipped: `eval/skipped_unhealthy`.
  2. load     `update_weights_from_disk(snapshot, version)` on every engine (the router remembers it, so
              an engine that fails it and comes back reloads it first), then `/flush_cache`: the
              previous snapshot's prefix cache must not serve this point's prompts (the same ones).
  3. verify   each engine, read back (`/model_info`; `/get_weight_version` on older SGLang), must report
              the point's version and the snapshot's path, and be in rotation.
  4. retry    once: the engines that failed 3 load the snapshot again, and 3 is repeated; an engine
              still not serving it skips the point: `eval/skipped_pin_violation` (one warning line names
              each engine and what it serves).
After the point, every generated token must carry the point's version (an engine restarted mid-point
with other weights would break that): otherwise the point is skipped as `pin_violation` too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

import structlog

from miles_aio.config import RunConfig
from miles_aio.data.source import PromptRecord
from miles_aio.errors import EngineError
from miles_aio.eval.snapshots import EvalSkip
from miles_aio.inference.availability import EngineState
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.engines import api_key_args
from miles_aio.inference.router import ADMIN_TIMEOUT_S, EngineClient, EngineRouter
from miles_aio.rollout.context import LimitedEngine, RolloutContext
from miles_aio.rollout.limiter import Limiter
from miles_aio.rollout.pool import GenerateFn, RewardFn
from miles_aio.types import Sample

__all__ = ["DedicatedEngineEval", "EvalFleet", "open_eval_engines"]

log = structlog.get_logger("miles_aio.eval")

PIN_RETRIES: Final = 1
"""Loads again of the engines that do not serve a point's snapshot before the point is skipped."""


@runtime_checkable
class EvalFleet(InferenceEngine, Protocol):
    """What pinning needs of the eval engines: an `EngineRouter` (one client and state per engine)."""

    @property
    def clients(self) -> tuple[EngineClient, ...]: ...

    @property
    def states(self) -> tuple[EngineState, ...]: ...

    async def health_generate(self) -> None: ...

    async def wait_for_healthy(self, n: int | None = None) -> None: ...


class DedicatedEngineEval:
    """The mode-2 evaluator: pins each point's snapshot on the fleet, then evaluates (module docstring)."""

    def __init__(
        self,
        *,
        engine: EvalFleet,
        ctx: RolloutContext,
        datasets: Mapping[str, Sequence[PromptRecord]],
        generate_fn: GenerateFn,
        reward_fn: RewardFn | None,
        concurrency: int,
        ready_timeout_s: float = ADMIN_TIMEOUT_S,
    ) -> None:
        """`ready_timeout_s`: how long a point waits for every engine to be in rotation (before loading,
        and after each load) before it is skipped."""
        from miles_aio.eval.shared import SharedEngineEval

        self.engine = engine
        self.ready_timeout_s = ready_timeout_s
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
        """Consumes: the snapshot dir. Waits for: every eval engine to serve it (`pin`), then the eval.
        Produces: eval/<ds>/*. Raises `EvalSkip` ("unhealthy", "pin_violation") to skip the point."""
        await self.pin(snapshot, version=version)
        metrics = await self._eval.evaluate()
        strays = sorted(
            {
                str(v)
                for samples in self._eval.last_samples.values()
                for s in samples
                for v, trained in zip(s.weight_versions, s.loss_mask, strict=False)
                if trained and v != version
            }
        )
        if strays:  # an engine changed weights mid-point (say, restarted): the point mixes versions
            log.warning(
                "eval point mixes weights; skipped", step=step, version=version, other_versions=strays
            )
            raise EvalSkip("pin_violation")
        return metrics

    async def pin(self, snapshot: Path, *, version: int) -> None:
        """Make every eval engine serve `snapshot` as `version`, or raise `EvalSkip` (see the module
        docstring: health first, load, read back, one retry)."""
        fleet, path = self.engine, str(snapshot)
        try:
            await fleet.health_generate()  # an engine that fails it is taken out of rotation
            async with asyncio.timeout(self.ready_timeout_s):
                await fleet.wait_for_healthy()
        except TimeoutError:
            down = {c.url: st.value for c, st in zip(fleet.clients, fleet.states, strict=True)}
            log.warning("eval engines not healthy; point skipped", version=version, engines=down)
            raise EvalSkip("unhealthy") from None
        await fleet.update_weights_from_disk(path, version=version)
        await fleet.flush_cache()
        for attempt in range(PIN_RETRIES + 1):
            wrong = await self._not_serving(path, version)
            if not wrong:
                return
            log.warning(
                "eval engines do not serve the point's snapshot",
                version=version,
                snapshot=path,
                attempt=attempt + 1,
                engines=wrong,
            )
            if attempt < PIN_RETRIES:
                await self._reload([c for c in fleet.clients if c.url in wrong], path, version)
        raise EvalSkip("pin_violation")

    async def _not_serving(self, path: str, version: int) -> dict[str, str]:
        """The engines not serving `path` as `version` (url → what is wrong), after waiting (bounded) for
        every engine to be back in rotation."""
        fleet = self.engine
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                await fleet.wait_for_healthy()
        except TimeoutError:
            pass  # those still out are reported below
        wrong: dict[str, str] = {}

        async def check(client: EngineClient, state: EngineState) -> None:
            if state is not EngineState.ACTIVE:
                wrong[client.url] = f"not in rotation ({state.value})"
                return
            try:
                async with asyncio.timeout(self.ready_timeout_s):
                    served = await client.weight_version()
                    model_info = getattr(client, "model_info", None)
                    served_path = None if model_info is None else (await model_info()).get("model_path")
            except (EngineError, TimeoutError) as e:
                wrong[client.url] = f"read-back failed: {e or 'timed out'}"
                return
            if served != version:
                wrong[client.url] = f"serves version {served}"
            elif served_path is not None and not _same_path(str(served_path), path):
                wrong[client.url] = f"serves {served_path}"

        async with asyncio.TaskGroup() as tg:
            for client, state in zip(fleet.clients, fleet.states, strict=True):
                tg.create_task(check(client, state), name="eval-pin-check")
        return wrong

    async def _reload(self, clients: Sequence[EngineClient], path: str, version: int) -> None:
        """The one retry: those engines load the snapshot again (a failure shows in the next read-back)."""

        async def load(client: EngineClient) -> None:
            try:
                async with asyncio.timeout(self.ready_timeout_s):
                    await client.update_weights_from_disk(path, version=version, flush_cache=False)
            except (EngineError, TimeoutError) as e:
                log.warning("eval engine reload failed", url=client.url, error=str(e) or "timed out")

        async with asyncio.TaskGroup() as tg:
            for client in clients:
                tg.create_task(load(client), name="eval-pin-reload")
        await self.engine.flush_cache()


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
                        max_running_requests=e.engine_max_running_requests,
                        log_dir=cfg.run_dir / "logs" / "eval",
                        api_key=e.sglang_api_key,
                    )
                )
        yield await stack.enter_async_context(
            EngineRouter.open(urls, api_key=e.sglang_api_key, batch_generate=e.engine_batch_generate)
        )


def _same_path(served: str, sent: str) -> bool:
    """Whether the engine reports the directory it was sent (SGLang echoes the path as sent, the
    embedded engine its real path)."""
    return served == sent or os.path.realpath(served) == os.path.realpath(sent)

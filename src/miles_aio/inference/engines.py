"""`open_engines`: the rollout engines of a run, as one `EngineRouter`, per `--rollout-backend`.

  local    `--rollout-num-gpus` embedded CPU engines (`miles_aio.inference.local`), started here
  sglang   `--rollout-num-gpus / --rollout-num-gpus-per-engine` SGLang servers, started here on the
           GPUs after the trainer's (`gpu_offset`), with every `--sglang-<flag>` passed through
  urls     `--sglang-urls`: servers (or one sglang-router) that are already running
Whatever started them stops them on every exit path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from miles_aio.config import RunConfig
from miles_aio.inference.router import EngineRouter

__all__ = ["open_engines"]


@asynccontextmanager
async def open_engines(
    cfg: RunConfig, *, model_path: Path, gpu_offset: int = 0, sglang_args: Sequence[str] = ()
) -> AsyncIterator[EngineRouter]:
    e = cfg.engine
    async with AsyncExitStack() as stack:
        if e.sglang_urls:
            urls = list(e.sglang_urls)
        elif e.rollout_backend == "sglang":
            from miles_aio.inference.sglang_launch import launch_sglang_servers

            urls = await stack.enter_async_context(
                launch_sglang_servers(
                    model_path,
                    num_engines=e.num_engines,
                    gpus_per_engine=e.rollout_num_gpus_per_engine,
                    gpu_offset=gpu_offset,
                    extra_args=sglang_args,
                    log_dir=cfg.run_dir / "logs",
                )
            )
        else:
            from miles_aio.inference.local.launch import launch_local_engines

            urls = await stack.enter_async_context(
                launch_local_engines(
                    model_path,
                    num_engines=e.num_engines,
                    weights_root=cfg.run_dir,
                    num_threads=e.engine_num_threads,
                    log_dir=cfg.run_dir / "logs",
                )
            )
        router = await stack.enter_async_context(
            EngineRouter.open(urls, api_key=e.sglang_api_key, partial_rollout=cfg.driver.partial_rollout)
        )
        yield router

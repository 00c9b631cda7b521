"""`open_engines`: the rollout engines of a run, as one `EngineRouter`, per `--rollout-backend`.

  local    `--rollout-num-gpus` embedded CPU engines (`miles_aio.engine`), started here
  sglang   `--rollout-num-gpus / --rollout-num-gpus-per-engine` SGLang servers, started here on the
           GPUs after the trainer's (`gpu_offset`), with every `--sglang-<flag>` passed through
  urls     `--sglang-urls`: servers (or one sglang-router) that are already running
Whatever started them stops them on every exit path.

`--pause-generation-mode in_place` on SGLang needs its radix cache off: requests frozen in place finish
on their pre-update KV, which SGLang's prefix cache would then serve to new requests (miles #2782; the
embedded engine tags its cache by weights epoch instead). `check_in_place_prefix_cache` refuses launched
servers without `--sglang-disable-radix-cache` before anything starts; servers given by URL are asked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from miles_aio.config import RunConfig
from miles_aio.errors import ConfigError
from miles_aio.inference.router import EngineRouter

__all__ = ["check_in_place_prefix_cache", "open_engines"]

_IN_PLACE_FLAGS = ["--pause-generation-mode", "--sglang-disable-radix-cache"]
_IN_PLACE_WHY = (
    "in_place lets requests finish on their pre-update KV, and SGLang's radix cache would serve that "
    "stale KV to new requests (miles #2782)"
)


def check_in_place_prefix_cache(cfg: RunConfig, sglang_args: Sequence[str]) -> None:
    """Before anything starts: SGLang servers this run launches for in_place need their radix cache off."""
    e = cfg.engine
    launched = e.rollout_backend == "sglang" and not e.sglang_urls
    if (
        cfg.driver.pause_generation_mode == "in_place"
        and launched
        and "--disable-radix-cache" not in sglang_args
    ):
        raise ConfigError(
            f"{_IN_PLACE_WHY}: add --sglang-disable-radix-cache, or use --pause-generation-mode retract",
            flags=_IN_PLACE_FLAGS,
        )


async def _ask_in_place_prefix_cache(router: EngineRouter) -> None:
    """Servers given by URL: refuse in_place on any whose /server_info says the radix cache is on."""
    for client in router.clients:
        if (await client.server_info()).get("disable_radix_cache") is False:
            raise ConfigError(
                f"{_IN_PLACE_WHY}; {client.url} runs with it: restart it with --disable-radix-cache, "
                "or use --pause-generation-mode retract",
                flags=_IN_PLACE_FLAGS,
            )


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
            from miles_aio.inference.local_launch import launch_local_engines

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
        if e.sglang_urls and cfg.driver.pause_generation_mode == "in_place":
            await _ask_in_place_prefix_cache(router)
        yield router

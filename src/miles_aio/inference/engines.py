"""`open_engines`: the rollout engines of a run, as one `EngineRouter`, per `--rollout-backend`.

  local    `--rollout-num-gpus` embedded CPU engines (`miles_aio.engine`), started here
  sglang   `--rollout-num-gpus / --rollout-num-gpus-per-engine` SGLang servers, started here on the
           GPUs after the trainer's (`gpu_offset`), with every `--sglang-<flag>` passed through
  vllm     `--rollout-num-gpus / --rollout-num-gpus-per-engine` vLLM servers, started here
           (`inference.vllm_launch`), spoken to by `VLLMClient` (`inference.vllm`); weights by broadcast on
           CUDA only (vLLM's transfer is NCCL), refused by `config.resolve` elsewhere
  urls     `--sglang-urls`: servers (or one sglang-router) that are already running;
           `--vllm-urls` (with `--rollout-backend vllm`): running vLLM servers
Whatever started them stops them on every exit path. `--sglang-api-key` is given to the engines started
here (as their `--api-key`, so they enforce it) and sent by the router to every engine, started or not.

Engines started here are supervised: one whose process dies is restarted (`--engine-max-restarts`,
`inference.supervisor`) and rejoins the router once it has the current weights; engines given by URL
rejoin when they answer again. Every weight-push call to an engine is bounded by
`--engine-admin-timeout-s` (the router excludes an engine that fails or misses it).

`--pause-generation-mode in_place` on SGLang needs its radix cache off: requests frozen in place finish
on their pre-update KV, which SGLang's prefix cache would then serve to new requests (miles #2782; the
embedded engine tags its cache by weights epoch instead). `check_in_place_prefix_cache` refuses launched
servers without `--sglang-disable-radix-cache` before anything starts; servers given by URL are asked.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from miles_aio.config import RunConfig
from miles_aio.errors import ConfigError, primary_error
from miles_aio.inference.availability import RestartPolicy
from miles_aio.inference.router import ClientFactory, EngineRouter, RouterPolicy
from miles_aio.inference.supervisor import EngineLauncher, EngineProcess, supervise_engines

__all__ = [
    "api_key_args",
    "check_in_place_prefix_cache",
    "open_engines",
    "vllm_launch_args",
]

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


def api_key_args(api_key: str | None) -> list[str]:
    """`--api-key KEY` for the SGLang servers a run launches (nothing without a key): `--sglang-api-key`
    is the run's own flag (its client sends it), so it is not among the passed-through `--sglang-*`."""
    return ["--api-key", api_key] if api_key else []


def vllm_launch_args(cfg: RunConfig) -> list[str]:
    """Arguments of the vLLM servers a run launches: the API key, and for `--pause-generation-mode
    in_place` prefix caching off (a request continued after the update would otherwise reuse its
    pre-update KV from the cache, and so would every new request sharing its prefix: miles #2782)."""
    args = api_key_args(cfg.engine.sglang_api_key)
    if cfg.driver.pause_generation_mode == "in_place":
        args.append("--no-enable-prefix-caching")
    if cfg.train.update_weight_transfer_mode == "broadcast":
        args += ["--weight-transfer-config", '{"backend": "nccl"}']  # vLLM's weight routes need it
    return args


async def _ask_in_place_prefix_cache(router: EngineRouter) -> None:
    """Servers given by URL: refuse in_place on any whose /server_info says the radix cache is on (not the
    embedded engine's prefix cache, which it tags by weights epoch: `engine` marks it in /server_info)."""
    for client in router.clients:
        info = await client.server_info()
        if info.get("disable_radix_cache") is False and info.get("engine") != "miles_aio-embedded":
            off = "--no-enable-prefix-caching" if info.get("engine") == "vllm" else "--disable-radix-cache"
            raise ConfigError(
                f"{_IN_PLACE_WHY}; {client.url} runs with it: restart it with {off}, "
                "or use --pause-generation-mode retract",
                flags=_IN_PLACE_FLAGS,
            )


@asynccontextmanager
async def open_engines(
    cfg: RunConfig, *, model_path: Path, gpu_offset: int = 0, sglang_args: Sequence[str] = ()
) -> AsyncIterator[EngineRouter]:
    e = cfg.engine
    launcher: EngineLauncher | None = None
    procs: Sequence[EngineProcess] = ()
    async with AsyncExitStack() as stack:
        if e.sglang_urls or e.vllm_urls:
            urls = list(e.sglang_urls or e.vllm_urls)
        elif e.rollout_backend == "vllm":
            from miles_aio.inference.vllm_launch import vllm_servers

            vllm = await stack.enter_async_context(
                vllm_servers(
                    model_path,
                    gpus_per_engine=e.rollout_num_gpus_per_engine,
                    gpu_offset=gpu_offset,
                    extra_args=vllm_launch_args(cfg),
                    log_dir=cfg.run_dir / "logs",
                )
            )
            launcher, procs = vllm, await vllm.start_all(e.num_engines)
        elif e.rollout_backend == "sglang":
            from miles_aio.inference.sglang_launch import sglang_servers

            servers = await stack.enter_async_context(
                sglang_servers(
                    model_path,
                    gpus_per_engine=e.rollout_num_gpus_per_engine,
                    gpu_offset=gpu_offset,
                    extra_args=[*sglang_args, *api_key_args(e.sglang_api_key)],
                    log_dir=cfg.run_dir / "logs",
                )
            )
            launcher, procs = servers, await servers.start_all(e.num_engines)
        else:
            from miles_aio.inference.local_launch import local_engines

            local = await stack.enter_async_context(
                local_engines(
                    model_path,
                    weights_root=cfg.run_dir,
                    num_threads=e.engine_num_threads,
                    max_running_requests=e.engine_max_running_requests,
                    log_dir=cfg.run_dir / "logs",
                    api_key=e.sglang_api_key,
                )
            )
            launcher, procs = local, await local.start_all(e.num_engines)
        if launcher is not None:
            urls = [p.url for p in procs]
        policy = RouterPolicy(
            admin_timeout_s=e.engine_admin_timeout_s,
            flush_attempts=e.engine_flush_attempts,
            flush_backoff_s=e.engine_flush_backoff_s,
        )
        factory: ClientFactory | None = None
        if e.rollout_backend == "vllm":
            from miles_aio.inference.vllm import VLLMClient

            factory = functools.partial(
                VLLMClient, api_key=e.sglang_api_key, partial_rollout=cfg.driver.partial_rollout
            )
        router = await stack.enter_async_context(
            EngineRouter.open(
                urls,
                api_key=e.sglang_api_key,
                partial_rollout=cfg.driver.partial_rollout,
                batch_generate=e.engine_batch_generate,  # SGLang-API clients (not a client_factory's)
                policy=policy,
                client_factory=factory,
            )
        )
        if (e.sglang_urls or e.vllm_urls) and cfg.driver.pause_generation_mode == "in_place":
            await _ask_in_place_prefix_cache(router)
        if launcher is None:
            yield router
            return
        # Launched engines: the supervisor restarts dead ones (stopped before the launcher stops them all)
        restarts = RestartPolicy(max_restarts=e.engine_max_restarts)
        body_error: Exception | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                supervisor = tg.create_task(
                    supervise_engines(router, launcher, procs, restarts), name="engine-supervisor"
                )
                try:
                    yield router
                except Exception as exc:  # re-raised below as itself, not wrapped in an ExceptionGroup
                    body_error = exc
                finally:
                    supervisor.cancel()
        except BaseExceptionGroup as eg:
            raise primary_error(eg)  # noqa: B904 - the supervisor's own error, with its cause chain
        if body_error is not None:
            raise body_error

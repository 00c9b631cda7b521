"""`launch_sglang_servers`: start SGLang servers for `--rollout-backend sglang`, always take them down.

    async with launch_sglang_servers(model_path, num_engines=2, gpus_per_engine=4, gpu_offset=8) as urls:
        ...  # urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]

Each engine is `python -m sglang.launch_server --model-path M --host H --port P --tp-size G ...` with
`CUDA_VISIBLE_DEVICES` set to its own G GPUs (after the trainer's, `gpu_offset`), plus every
`--sglang-<flag>` the user passed, forwarded as `--<flag>`. Readiness is `/health_generate` answering 200;
each server's output goes to `<log_dir>/sglang-<i>.log`. The process handling (a process group per
server, teardown on every exit path, death with the controller, restarts) is `server_launch`'s, shared
with the vLLM launcher. `sglang_servers()` is the launcher underneath, for the supervisor that restarts
dead engines (`inference.supervisor`).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Final, Unpack

from miles_aio.inference.server_launch import HTTPServers, LaunchOptions, ServerKind, free_port, http_servers

__all__ = [
    "SGLANG",
    "SGLangStartError",
    "free_port",
    "launch_sglang_servers",
    "sglang_command",
    "sglang_servers",
]


class SGLangStartError(RuntimeError):
    """A server exited, or was not healthy by the deadline."""


def sglang_command(
    model_path: str, *, host: str, port: int, tp_size: int, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path, "--host", host, "--port", str(port), "--tp-size", str(tp_size),
        *extra_args,
    ]  # fmt: skip


SGLANG: Final = ServerKind(
    name="sglang",
    title="SGLang",
    health_path="/health_generate",  # /health answers before the scheduler can generate
    command=sglang_command,
    start_error=SGLangStartError,
)


def sglang_servers(
    model_path: Path | str, **options: Unpack[LaunchOptions]
) -> AbstractAsyncContextManager[HTTPServers]:
    """A launcher of SGLang servers; every server it started is taken down on exit (the whole group)."""
    return http_servers(SGLANG, model_path, **options)


@asynccontextmanager
async def launch_sglang_servers(
    model_path: Path | str, *, num_engines: int, **options: Unpack[LaunchOptions]
) -> AsyncIterator[list[str]]:
    """Start `num_engines` servers and yield their URLs once every one is healthy.

    `commands` replaces the SGLang command lines (one per engine, each must serve on the port its
    URL names): the tests run the embedded engine through this same launcher.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    async with sglang_servers(model_path, **options) as launcher:
        yield [s.url for s in await launcher.start_all(num_engines)]

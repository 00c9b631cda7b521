"""`launch_sglang_servers`: start SGLang servers for `--rollout-backend sglang`, always take them down.

    async with launch_sglang_servers(model_path, num_engines=2, gpus_per_engine=4, gpu_offset=8) as urls:
        ...  # urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]

Each engine is `python -m sglang.launch_server --model-path M --host H --port P --tp-size G ...` with
`CUDA_VISIBLE_DEVICES` set to its own G GPUs (after the trainer's, `gpu_offset`), plus every
`--sglang-<flag>` the user passed, forwarded as `--<flag>`. SGLang prints no machine-readable ready
line, so readiness is `/health_generate` answering 200 — probed every `_PROBE_INTERVAL_S` until a
deadline, while also watching for the process to die (then the tail of its log is raised). Each
server's output goes to `<log_dir>/sglang-<i>.log`.

Each engine runs in its own session (process group), because SGLang forks scheduler and detokenizer
processes: teardown signals the whole group — SIGTERM, `_TERM_GRACE_S` to exit, then SIGKILL — on every
exit path (normal, exception, Ctrl-C), so no GPU is left held by an orphan. If the controller dies
without a teardown (SIGKILL, OOM killer), each server gets SIGTERM from the kernel (`PR_SET_PDEATHSIG`,
see `_pdeathsig`) and takes its own children down.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
import structlog

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.inference._pdeathsig import die_with_parent

__all__ = ["SGLangStartError", "launch_sglang_servers", "sglang_command"]

log = structlog.get_logger("miles_aio.inference.sglang_launch")
_PROBE_INTERVAL_S: Final = 2.0  # how often an unready server is asked /health_generate
_TERM_GRACE_S: Final = 15.0
_TAIL_LINES: Final = 80


class SGLangStartError(RuntimeError):
    """A server exited, or was not healthy by the deadline."""


@dataclass(eq=False)
class _Server:
    index: int
    url: str
    proc: asyncio.subprocess.Process
    log_path: Path

    def stderr_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_TAIL_LINES:]
        except OSError:
            return "(no output)"
        return "\n".join(lines) or "(no output)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def sglang_command(
    model_path: str, *, host: str, port: int, tp_size: int, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path, "--host", host, "--port", str(port), "--tp-size", str(tp_size),
        *extra_args,
    ]  # fmt: skip


@asynccontextmanager
async def launch_sglang_servers(
    model_path: Path | str,
    *,
    num_engines: int,
    gpus_per_engine: int = 1,
    gpu_offset: int = 0,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 900.0,
    log_dir: Path | str = ".",
    commands: Sequence[Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[list[str]]:
    """Start `num_engines` servers and yield their URLs once every one is healthy.

    `commands` replaces the SGLang command lines (one per engine, each must serve on the port its
    URL names): the tests run the embedded engine through this same launcher.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[_Server] = []
    try:
        for i in range(num_engines):
            port = free_port(host)
            if commands is not None:
                cmd = list(commands[i])
                port = int(cmd[cmd.index("--port") + 1])
            else:
                cmd = sglang_command(
                    str(model_path), host=host, port=port, tp_size=gpus_per_engine, extra_args=extra_args
                )
            gpus = range(gpu_offset + i * gpus_per_engine, gpu_offset + (i + 1) * gpus_per_engine)
            child_env = {**os.environ, **(env or {}), "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
            log_path = log_dir / f"sglang-{i}.log"
            with log_path.open("ab") as out:
                proc = await asyncio.create_subprocess_exec(
                    *die_with_parent(cmd),  # SIGTERM when this process dies, even by SIGKILL
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=child_env,
                    start_new_session=True,  # its own process group: teardown reaches SGLang's children
                )
            servers.append(_Server(i, f"http://{host}:{port}", proc, log_path))
        try:
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client,
                asyncio.timeout(ready_timeout_s),
            ):
                await asyncio.gather(*(_wait_healthy(client, s) for s in servers))
        except TimeoutError:
            raise SGLangStartError(
                f"SGLang servers not healthy after {ready_timeout_s} s:\n"
                + "\n".join(f"[engine {s.index}] {s.stderr_tail()}" for s in servers)
            ) from None
        log.info("sglang servers ready", urls=[s.url for s in servers])
        yield [s.url for s in servers]
    finally:
        await finish_even_if_cancelled(_stop_all(servers))  # even when cancelled: no orphan may keep a GPU


async def _wait_healthy(client: httpx.AsyncClient, server: _Server) -> None:
    while True:
        if server.proc.returncode is not None:
            raise SGLangStartError(
                f"engine {server.index} exited with code {server.proc.returncode} before it was healthy:\n"
                f"{server.stderr_tail()}"
            )
        with contextlib.suppress(httpx.TransportError):
            if (await client.get(f"{server.url}/health_generate")).status_code == 200:
                return
        # A deliberate probe interval: the server offers nothing to wait on until it listens.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.proc.wait(), timeout=_PROBE_INTERVAL_S)


async def _stop_all(servers: list[_Server]) -> None:
    await asyncio.gather(*(_stop(s) for s in servers))


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _stop(server: _Server) -> None:
    proc = server.proc
    _signal_group(proc, signal.SIGTERM)  # even if the leader exited, its children may not have
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), timeout=_TERM_GRACE_S)
        except TimeoutError:
            log.warning("sglang server did not exit after SIGTERM; killing", index=server.index, pid=proc.pid)
    _signal_group(proc, signal.SIGKILL)
    await proc.wait()
